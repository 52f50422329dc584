// Drawing messages. Model output is text, never HTML: every piece of it goes into the page
// through textContent or a text node. The one bit of markup, ``` fences, becomes <pre> elements
// made here whose content is again set as text; nothing is ever parsed as HTML.

import { fillCalls } from "./tools.js";

const ROLES = {
  user: "you", assistant: "model", tool: "tool result", prompt: "prompt", completion: "completion",
};

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

export function fillText(body, text) {
  body.replaceChildren();
  text.split("```").forEach((part, i) => {
    if (i % 2 === 0) {
      if (part) body.append(document.createTextNode(part));
      return;
    }
    const code = element("code", "", part.replace(/^[\w+.-]*\n/, ""));  // drop a language tag
    const pre = element("pre");
    pre.append(code);
    body.append(pre);
  });
}

// A probability's class, p0 (< 0.1) to p4 (>= 0.9), coloured by playground.css.
function bin(logprob) {
  const p = Math.exp(logprob);
  return p >= 0.9 ? 4 : p >= 0.6 ? 3 : p >= 0.3 ? 2 : p >= 0.1 ? 1 : 0;
}

export function fillTokens(body, tokens) {
  body.replaceChildren(
    ...tokens.map((token, i) => {
      const span = element("span", `tok p${bin(token.logprob)}`, token.token);
      span.dataset.token = String(i);
      return span;
    }),
  );
}

export function fillBody(body, message, tokenView) {
  if (tokenView && message.tokens && message.tokens.length) fillTokens(body, message.tokens);
  else fillText(body, message.content);
}

export function statsText(stats) {
  if (!stats) return "";
  const parts = [];
  if (stats.ttft !== null) parts.push(`TTFT ${Math.round(stats.ttft)} ms`);
  if (stats.rate !== null) parts.push(`${stats.rate.toFixed(1)} tok/s`);
  parts.push(`${stats.approx ? "~" : ""}${stats.tokens} tokens`);
  if (stats.finish) parts.push(stats.finish);
  return parts.join(" · ");
}

export function messageElement(message, index, tokenView) {
  const node = element("div", `msg ${message.role}`);
  node.dataset.index = String(index);
  const body = element("div", "body");
  fillBody(body, message, tokenView);
  const calls = element("div", "calls");
  fillCalls(calls, message.tool_calls);
  const stats = element("div", message.error ? "stats error" : "stats");
  stats.textContent = message.error || statsText(message.stats);
  const role = ROLES[message.role] || message.role;
  const of = message.role === "tool" && message.name ? ` · ${message.name}` : "";
  node.append(element("div", "role", role + of), body, calls, stats);
  return node;
}

function percent(logprob) {
  const p = Math.exp(logprob) * 100;
  const text = p < 0.1 ? "<0.1" : p < 10 ? p.toFixed(1) : p.toFixed(0);
  return `${text}%`.padStart(6);
}

// The hovered token and its top alternatives; JSON quotes show spaces and line breaks.
export function showTip(tip, target, token) {
  const line = (t) => `${percent(t.logprob)}  ${JSON.stringify(t.token)}`;
  const others = (token.top || []).map(line);
  tip.textContent = [line(token), ...(others.length ? ["top:", ...others] : [])].join("\n");
  const box = target.getBoundingClientRect();
  tip.style.left = `${Math.min(box.left, window.innerWidth - 260)}px`;
  tip.style.top = `${box.bottom + 4}px`;
  tip.hidden = false;
}

export function conversationItem(conversation, current, onOpen, onDelete) {
  const item = element("li", conversation.id === current ? "current" : "");
  const open = element("button", "", conversation.title || "New chat");
  open.type = "button";
  open.title = conversation.title || "";
  open.addEventListener("click", () => onOpen(conversation.id));
  const remove = element("button", "", "×");
  remove.type = "button";
  remove.title = "delete";
  remove.addEventListener("click", () => onDelete(conversation.id));
  item.append(open, remove);
  return item;
}
