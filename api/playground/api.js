// Calls to this server's API: JSON, and server-sent events read from a fetch's body.
// The key goes in the Authorization header, never in a URL (URLs end up in logs and history).

import { apiKey } from "./settings.js";

export class APIError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function headers(json) {
  const out = {};
  if (json) out["Content-Type"] = "application/json";
  const key = apiKey();
  if (key) out.Authorization = `Bearer ${key}`;
  return out;
}

async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (_) {
    // not JSON: the status says enough
  }
  return new APIError(response.status, message);
}

export async function getJSON(path) {
  const response = await fetch(path, { headers: headers(false) });
  if (!response.ok) throw await failure(response);
  return response.json();
}

// POST a streaming request; yields each event's JSON until [DONE]. `signal` aborts the fetch,
// which closes the connection: the server sees the disconnect and frees the request.
export async function* streamEvents(path, body, signal) {
  const response = await fetch(path, {
    method: "POST",
    headers: headers(true),
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const events = buffer.split(/\r?\n\r?\n/);
    buffer = events.pop();
    for (const event of events) {
      const data = dataOf(event);
      if (data === null) continue;  // a comment (keep-alive) or an empty event
      if (data === "[DONE]") return;
      const payload = JSON.parse(data);
      if (payload.error) throw new APIError(0, payload.error.message);  // in-band, after 200
      yield payload;
    }
  }
}

function dataOf(event) {
  const lines = event.split(/\r?\n/).filter((line) => line.startsWith("data:"));
  if (!lines.length) return null;
  return lines.map((line) => line.slice(5).replace(/^ /, "")).join("\n");
}
