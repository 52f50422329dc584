// The settings panel: kept in localStorage (all but the API key), read into request bodies.

import { sentMessages } from "./tools.js";

const SETTINGS = "playground.settings";
const KEY = "playground.apiKey";
// Sent as numbers when set; an empty field leaves the server's default.
const NUMBERS = [
  "temperature", "top_p", "top_k", "min_p", "max_tokens", "seed",
  "presence_penalty", "frequency_penalty", "repetition_penalty",
];
const DEFAULT_TOP_LOGPROBS = 5;

// The API key lives in sessionStorage: this tab only, gone when the tab closes. Not in
// localStorage by default, because that keeps it on disk with no end date, readable by every
// page this origin serves; the "remember" box opts into that for a private machine.
export function apiKey() {
  return sessionStorage.getItem(KEY) || localStorage.getItem(KEY) || "";
}

export function rememberedKey() {
  return localStorage.getItem(KEY) !== null;
}

export function setApiKey(key, remember) {
  for (const store of [sessionStorage, localStorage]) store.removeItem(KEY);
  if (!key) return;
  sessionStorage.setItem(KEY, key);
  if (remember) localStorage.setItem(KEY, key);
}

function fields() {
  return [...document.querySelectorAll("[data-setting]")];
}

export function readSettings() {
  const out = {};
  for (const field of fields()) {
    out[field.dataset.setting] = field.type === "checkbox" ? field.checked : field.value;
  }
  out.mode = localStorage.getItem("playground.mode") || "chat";
  return out;
}

export function saveSettings() {
  const { mode, ...values } = readSettings();
  if (!values.model) values.model = savedSettings().model;  // the list has not come yet
  localStorage.setItem(SETTINGS, JSON.stringify(values));
}

export function savedSettings() {
  try {
    return JSON.parse(localStorage.getItem(SETTINGS) || "{}") || {};
  } catch (_) {
    return {};  // a damaged entry: start over rather than fail
  }
}

// Fill the panel from storage; the model is chosen once /v1/models has answered.
export function restoreSettings() {
  const saved = savedSettings();
  for (const field of fields()) {
    const value = saved[field.dataset.setting];
    if (value === undefined || field.id === "model") continue;
    if (field.type === "checkbox") field.checked = Boolean(value);
    else field.value = value;
  }
}

export function setMode(mode) {
  localStorage.setItem("playground.mode", mode);
}

function stopStrings(text) {
  // one a line; "\n" written out stands for a line break
  return text.split("\n").filter((line) => line !== "").map((line) => line.replace(/\\n/g, "\n"));
}

const isObject = (value) => value !== null && typeof value === "object" && !Array.isArray(value);

// A JSON box: empty is off (null); text that is not JSON, or not what `check` wants, is an error.
function parsed(text, check, wanted) {
  if (!text.trim()) return { value: null, error: "" };
  let value;
  try {
    value = JSON.parse(text);
  } catch (err) {
    return { value: null, error: `not JSON (${err.message})` };
  }
  return check(value) ? { value, error: "" } : { value: null, error: `not ${wanted}` };
}

// The JSON-schema box (response_format) and the tools box, read and checked.
export function jsonBoxes(s = readSettings()) {
  return {
    schema: parsed(s.schema || "", isObject, "a JSON object (a schema)"),
    tools: parsed(s.tools || "", (v) => Array.isArray(v) && v.every(isObject),
      "a JSON array of tools"),
  };
}

// Each box's error shown beside it; returns the first, or "" when both are fine.
export function showBoxErrors() {
  const boxes = jsonBoxes();
  const names = { schema: "the JSON-schema box", tools: "the tools box" };
  let first = "";
  for (const [name, { error }] of Object.entries(boxes)) {
    const shown = document.getElementById(`${name}-error`);
    shown.textContent = error && `${error[0].toUpperCase()}${error.slice(1)}.`;
    shown.hidden = !error;
    if (error && !first) first = `Not sent: ${names[name]} under Settings is ${error}.`;
  }
  return first;
}

// The body of a streaming request: `history` is the conversation's messages, its last entry
// the user's (or the results of the tool calls before it).
export function requestBody(mode, history) {
  const s = readSettings();
  const body = { model: s.model, stream: true, stream_options: { include_usage: true } };
  const { schema, tools } = jsonBoxes(s);
  if (schema.value) {
    const format = { name: "playground", schema: schema.value, strict: true };
    body.response_format = { type: "json_schema", json_schema: format };
  }
  for (const name of NUMBERS) {
    if (s[name] !== "" && s[name] !== undefined) body[name] = Number(s[name]);
  }
  const stop = stopStrings(s.stop || "");
  if (stop.length) body.stop = stop;
  const top = s.top_logprobs === "" ? DEFAULT_TOP_LOGPROBS : Number(s.top_logprobs);
  if (mode === "completion") {
    body.prompt = history[history.length - 1].content;
    if (s.logprobs) body.logprobs = top;
    return body;
  }
  const system = s.system ? [{ role: "system", content: s.system }] : [];
  body.messages = [...system, ...sentMessages(history)];
  if (tools.value && tools.value.length) {
    body.tools = tools.value;
    body.tool_choice = s.tool_choice || "auto";
  }
  if (s.logprobs) Object.assign(body, { logprobs: true, top_logprobs: top });
  return body;
}
