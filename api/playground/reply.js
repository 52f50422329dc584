// One reply as it streams in: its text, its tokens with their log-probabilities, its tool
// calls, its figures.

import { absorbToolCalls } from "./tools.js";

// Tokens of a chat chunk's `logprobs.content`. A token's own text is "" where it holds only
// part of a character; its bytes, decoded in order, give each token the characters it ends.
function chatTokens(logprobs, decoder) {
  return ((logprobs && logprobs.content) || []).map((entry) => ({
    token: entry.bytes ? decoder.decode(new Uint8Array(entry.bytes), { stream: true }) : entry.token,
    logprob: entry.logprob,
    top: (entry.top_logprobs || []).map(({ token, logprob }) => ({ token, logprob })),
  }));
}

// Tokens of a completion chunk's `logprobs`: parallel lists, the top ones as {text: logprob}.
function completionTokens(logprobs) {
  if (!logprobs || !logprobs.tokens) return [];
  return logprobs.tokens.map((token, i) => ({
    token,
    logprob: logprobs.token_logprobs[i],
    top: Object.entries(logprobs.top_logprobs[i] || {}).map(([text, logprob]) => ({
      token: text,
      logprob,
    })),
  }));
}

export class Reply {
  constructor(mode, withTokens) {
    this.mode = mode;
    this.message = { role: "assistant", content: "", tokens: withTokens ? [] : null };
    this.started = performance.now();
    this.first = null;  // when the first text came
    this.last = null;
    this.pieces = 0;  // chunks that carried text or calls: the count when nothing better is known
    this.usage = null;  // the server's count, from the last chunk (stream_options.include_usage)
    this.finish = null;
    this.decoder = new TextDecoder();
  }

  // One SSE chunk of /v1/chat/completions or /v1/completions.
  absorb(chunk) {
    if (chunk.usage) this.usage = chunk.usage.completion_tokens;
    const choice = chunk.choices && chunk.choices[0];
    if (!choice) return;
    const chat = this.mode === "chat";
    const text = chat ? choice.delta && choice.delta.content : choice.text;
    const tokens = chat
      ? chatTokens(choice.logprobs, this.decoder)
      : completionTokens(choice.logprobs);
    const calls = chat && choice.delta && choice.delta.tool_calls;
    if (text || tokens.length || calls) {
      const now = performance.now();
      if (this.first === null) this.first = now;
      this.last = now;
      this.pieces += 1;
    }
    if (text) this.message.content += text;
    if (this.message.tokens) this.message.tokens.push(...tokens);
    if (calls) absorbToolCalls((this.message.tool_calls ??= []), calls);
    if (choice.finish_reason) this.finish = choice.finish_reason;
  }

  // Time to first token, tokens per second after it, and the count.
  stats() {
    const counted = this.message.tokens ? this.message.tokens.length : 0;
    const tokens = this.usage ?? (counted || this.pieces);
    const decoding = this.last !== null && this.last > this.first ? this.last - this.first : 0;
    return {
      ttft: this.first === null ? null : this.first - this.started,
      rate: tokens > 1 && decoding ? ((tokens - 1) * 1000) / decoding : null,
      tokens,
      approx: this.usage === null && !counted,
      finish: this.finish,
    };
  }
}
