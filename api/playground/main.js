// The playground: conversations, sending, stopping, regenerating, answering tool calls; the
// panels around them.

import { getJSON, streamEvents } from "./api.js";
import { resumeLoads, startLoads } from "./loads.js";
import {
  conversationItem, fillBody, messageElement, showTip, statsText,
} from "./render.js";
import { Reply } from "./reply.js";
import {
  apiKey, readSettings, rememberedKey, requestBody, restoreSettings, savedSettings,
  saveSettings, setApiKey, setMode, showBoxErrors,
} from "./settings.js";
import { loadConversations, newConversation, saveConversations, savedCurrent } from "./store.js";
import { fillCalls, pendingCalls, resultsForm } from "./tools.js";

const $ = (id) => document.getElementById(id);
const PATHS = { chat: "v1/chat/completions", completion: "v1/completions" };
const state = { conversations: [], current: null, controller: null };

function conversation() {
  return state.conversations.find((c) => c.id === state.current);
}

function save() {
  saveConversations(state.conversations, state.current);
}

function notice(text) {
  $("notice").textContent = text;
  $("notice").hidden = !text;
}

function renderMessages() {
  const view = readSettings().logprobs;
  const messages = conversation().messages;
  const nodes = messages.map((m, i) => messageElement(m, i, view));
  const calls = pendingCalls(messages);
  if (calls.length && !state.controller) nodes[nodes.length - 1].append(resultsForm(calls, answer));
  $("messages").replaceChildren(...nodes);
  $("messages").scrollTop = $("messages").scrollHeight;
}

function renderConversations() {
  const items = state.conversations.map((c) =>
    conversationItem(c, state.current, openConversation, deleteConversation));
  $("conversation-list").replaceChildren(...items);
}

function renderMode() {
  const mode = readSettings().mode;
  for (const button of document.querySelectorAll("[data-mode]")) {
    button.classList.toggle("on", button.dataset.mode === mode);
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("regenerate").disabled = busy;
  $("edit-last").disabled = busy;
}

function openConversation(id) {
  if (state.controller) state.controller.abort();
  state.current = id;
  save();
  renderConversations();
  renderMessages();
}

function deleteConversation(id) {
  if (id === state.current && state.controller) state.controller.abort();
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (!state.conversations.length) state.conversations.push(newConversation());
  if (!conversation()) state.current = state.conversations[0].id;
  save();
  renderConversations();
  renderMessages();
}

function startConversation() {
  const fresh = newConversation();
  state.conversations.unshift(fresh);
  openConversation(fresh.id);
  $("input").focus();
}

// Stream one reply to the conversation's last message, drawing it as it grows.
async function generate() {
  const conv = conversation();
  const mode = readSettings().mode;
  const body = requestBody(mode, conv.messages);
  const reply = new Reply(mode, Boolean(body.logprobs));
  conv.messages.push(reply.message);
  renderMessages();
  const node = $("messages").lastElementChild;
  node.classList.add("streaming");
  let drawing = false;
  const draw = () => {
    drawing = false;
    fillBody(node.querySelector(".body"), reply.message, readSettings().logprobs);
    fillCalls(node.querySelector(".calls"), reply.message.tool_calls);
    node.querySelector(".stats").textContent = statsText(reply.stats());
    $("messages").scrollTop = $("messages").scrollHeight;
  };
  state.controller = new AbortController();
  setBusy(true);
  notice("");
  try {
    for await (const chunk of streamEvents(PATHS[mode], body, state.controller.signal)) {
      reply.absorb(chunk);
      if (!drawing) requestAnimationFrame(draw);  // at most one redraw a frame
      drawing = true;
    }
  } catch (err) {
    if (err.name === "AbortError") reply.finish = "stopped";
    else if (err.status) reply.message.error = `The server answered ${err.status}: ${err.message}`;
    else reply.message.error = err.message;
  } finally {
    state.controller = null;
    setBusy(false);
    reply.message.stats = reply.stats();
    conv.updated = Date.now();
    save();
    renderMessages();
  }
}

function send(text) {
  const conv = conversation();
  conv.messages.push({ role: "user", content: text });
  if (!conv.title) {
    conv.title = text.slice(0, 60);
    renderConversations();
  }
  generate();
}

// The JSON boxes under Settings must parse before anything is sent.
function ready() {
  const error = showBoxErrors();
  notice(error);
  return !error;
}

function regenerate() {
  if (!ready()) return;
  const messages = conversation().messages;
  if (messages.length && messages[messages.length - 1].role === "assistant") messages.pop();
  const last = messages.length ? messages[messages.length - 1].role : null;
  if (last === "user" || last === "tool") generate();
}

// The results typed for the last reply's tool calls, as tool messages; then the next reply.
function answer(results) {
  if (state.controller || !ready()) return;
  conversation().messages.push(...results);
  generate();
}

// The last message of yours back into the box, and what came after it gone.
function editLast() {
  const messages = conversation().messages;
  const last = messages.map((m) => m.role).lastIndexOf("user");
  if (last < 0) return;
  $("input").value = messages[last].content;
  messages.splice(last);
  save();
  renderMessages();
  $("input").focus();
}

async function loadModels() {
  try {
    const { data } = await getJSON("v1/models");
    const select = $("model");
    select.replaceChildren(...data.map(({ id }) => new Option(id, id)));
    const saved = savedSettings().model;
    if (data.some(({ id }) => id === saved)) select.value = saved;
    notice("");
  } catch (err) {
    const key = "This server wants an API key: type it under Settings.";
    notice(err.status === 401 ? key : `Could not list the models: ${err.message}`);
  }
}

function hookComposer() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("input").value.trim();
    if (!text || state.controller || !ready()) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("edit-last").addEventListener("click", editLast);
  $("new-chat").addEventListener("click", startConversation);
}

function hookSettings() {
  for (const button of document.querySelectorAll("[data-mode]")) {
    button.addEventListener("click", () => {
      setMode(button.dataset.mode);
      renderMode();
    });
  }
  $("settings").addEventListener("submit", (event) => event.preventDefault());
  $("settings").addEventListener("change", (event) => {
    saveSettings();
    if (event.target.dataset.setting === "logprobs") renderMessages();
  });
  $("settings").addEventListener("input", (event) => {
    if (event.target === $("schema") || event.target === $("tools")) showBoxErrors();
  });
  const keyChanged = () => {
    setApiKey($("api-key").value.trim(), $("remember-key").checked);
    loadModels();
    resumeLoads();
  };
  $("api-key").addEventListener("change", keyChanged);
  $("remember-key").addEventListener("change", keyChanged);
}

function hookTokenTips() {
  const tip = $("tip");
  $("messages").addEventListener("mouseover", (event) => {
    const span = event.target.closest(".tok");
    if (!span) return;
    const message = conversation().messages[Number(span.closest(".msg").dataset.index)];
    const token = message && message.tokens && message.tokens[Number(span.dataset.token)];
    if (token) showTip(tip, span, token);
  });
  $("messages").addEventListener("mouseout", () => {
    tip.hidden = true;
  });
}

function start() {
  restoreSettings();
  showBoxErrors();
  $("api-key").value = apiKey();
  $("remember-key").checked = rememberedKey();
  state.conversations = loadConversations();
  if (!state.conversations.length) state.conversations.push(newConversation());
  const saved = savedCurrent();
  state.current = state.conversations.some((c) => c.id === saved)
    ? saved : state.conversations[0].id;
  hookComposer();
  hookSettings();
  hookTokenTips();
  renderMode();
  renderConversations();
  renderMessages();
  setBusy(false);
  loadModels();
  startLoads();
}

start();
