// The live panel: /v1/loads every couple of seconds (running, waiting, KV use, throughput).

import { getJSON } from "./api.js";

const PERIOD_MS = 2000;
let paused = false;  // after a 401, until the key changes: no request that must fail

function set(id, text) {
  document.getElementById(id).textContent = text;
}

function show(loads) {
  const sum = (name) => loads.reduce((total, load) => total + (load[name] || 0), 0);
  const capacity = sum("max_total_num_tokens");
  set("load-running", String(sum("num_running_reqs")));
  set("load-waiting", String(sum("num_waiting_reqs")));
  set("load-kv", capacity ? `${((100 * sum("num_used_tokens")) / capacity).toFixed(1)}%` : "–");
  set("load-tps", sum("gen_throughput").toFixed(1));
}

async function poll() {
  if (paused || document.hidden) return;
  try {
    show((await getJSON("v1/loads")).loads || []);
  } catch (err) {
    paused = err.status === 401;
    set("load-running", paused ? "needs the API key" : "?");
  }
}

export function startLoads() {
  poll();
  setInterval(poll, PERIOD_MS);
}

export function resumeLoads() {
  paused = false;
  poll();
}
