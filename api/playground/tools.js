// Tool calls: gathered from a reply's streamed deltas, drawn as text, answered by the user.
//
// The history sent back keeps an assistant's call only where a tool message answers it (the
// results typed under the reply). A call left unanswered, or cut short by Stop, is left out,
// so the server (or OpenAI) is never sent a call without its result, nor a result without its
// call ("answers no call").

// Streamed `delta.tool_calls`, as the openai client accumulates them: by `index`, the id,
// type and name once, then fragments of the arguments' text.
export function absorbToolCalls(calls, deltas) {
  for (const delta of deltas) {
    const index = delta.index ?? 0;
    calls[index] ??= { id: "", type: "function", function: { name: "", arguments: "" } };
    const call = calls[index];
    if (delta.id) call.id = delta.id;
    if (delta.type) call.type = delta.type;
    const fn = delta.function || {};
    if (fn.name) call.function.name += fn.name;
    if (fn.arguments) call.function.arguments += fn.arguments;
  }
}

// get_weather({"city": "Paris"}): the call as the model wrote it.
export function callText(call) {
  return `${call.function.name}(${call.function.arguments})`;
}

// A call the server would take back: an id, a name, arguments that are a JSON object.
export function isComplete(call) {
  if (!call || !call.id || !call.function.name) return false;
  try {
    const args = JSON.parse(call.function.arguments);
    return args !== null && typeof args === "object" && !Array.isArray(args);
  } catch (_) {
    return false;
  }
}

// The calls of the conversation's last message that wait for results: only an assistant
// reply that ended, without an error, can be answered.
export function pendingCalls(messages) {
  const last = messages[messages.length - 1];
  if (!last || last.role !== "assistant" || last.error || !last.tool_calls) return [];
  return last.tool_calls.filter(isComplete);
}

// The chat history as the server gets it (see the top of this file).
export function sentMessages(history) {
  const answered = new Set(history.filter((m) => m.role === "tool").map((m) => m.tool_call_id));
  return history
    .filter((m) => !m.error)
    .map((m) => {
      if (m.role === "tool") {
        return { role: "tool", tool_call_id: m.tool_call_id, content: m.content };
      }
      const calls = (m.tool_calls || []).filter((c) => c && answered.has(c.id));
      if (!calls.length) return { role: m.role, content: m.content };
      const sent = calls.map(({ id, type, function: { name, arguments: args } }) => ({
        id, type, function: { name, arguments: args },
      }));
      return { role: m.role, content: m.content || null, tool_calls: sent };
    });
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// The reply's calls, one line each, as text.
export function fillCalls(container, calls) {
  const lines = (calls || []).filter(Boolean).map((call) => element("div", "call", callText(call)));
  container.replaceChildren(...lines);
}

// A result box per call waiting for one, and a button that sends them all:
// `onResults` gets [{role: "tool", tool_call_id, name, content}] (`name` is for the page).
export function resultsForm(calls, onResults) {
  const form = element("form", "results");
  const inputs = calls.map((call) => {
    const input = element("input");
    input.placeholder = "what it returned";
    input.dataset.call = call.id;
    const label = element("label", "", `result of ${call.function.name} `);
    label.append(input);
    form.append(label);
    return input;
  });
  const button = element("button", "", calls.length > 1 ? "Send results" : "Send result");
  button.type = "submit";
  form.append(button);
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    onResults(calls.map((call, i) => ({
      role: "tool", tool_call_id: call.id, name: call.function.name, content: inputs[i].value,
    })));
  });
  return form;
}
