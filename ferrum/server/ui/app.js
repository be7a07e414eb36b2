// Ferrum's chat page: a client of the public /v1 API (chat completions, streamed), nothing more.
// Conversations live in this browser's localStorage; an API key, when the server asks for one, in
// sessionStorage (this tab only). Model output is untrusted: markdown is rendered, then sanitised.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "ferrum.conversations";
const KEY = "ferrum.apiKey";
const state = { conversations: load(), current: null, controller: null };

function load() {
  try { return JSON.parse(localStorage.getItem(STORE)) || []; } catch { return []; }
}
function save() { localStorage.setItem(STORE, JSON.stringify(state.conversations)); }
function conversation() { return state.conversations.find((c) => c.id === state.current); }

function newConversation() {
  const c = { id: String(Date.now()) + Math.random().toString(16).slice(2, 6), title: "New chat", messages: [] };
  state.conversations.unshift(c);
  state.current = c.id;
  save();
  render();
}

function renderMarkdown(text) {
  return DOMPurify.sanitize(marked.parse(text || ""));
}

function messageElement(m) {
  const el = document.createElement("div");
  el.className = `message ${m.role}`;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = m.role === "user" ? "You" : "Assistant";
  const content = document.createElement("div");
  content.className = "content";
  if (m.role === "assistant") content.innerHTML = renderMarkdown(m.content);
  else content.textContent = m.content;
  el.append(role, content);
  if (m.stats) {
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.textContent = m.stats;
    el.append(stats);
  }
  return el;
}

function render() {
  const list = $("conversations");
  list.replaceChildren(...state.conversations.map((c) => {
    const li = document.createElement("li");
    li.className = c.id === state.current ? "active" : "";
    li.textContent = c.title;
    li.onclick = () => { state.current = c.id; render(); };
    const del = document.createElement("button");
    del.textContent = "×";
    del.title = "Delete";
    del.onclick = (e) => {
      e.stopPropagation();
      state.conversations = state.conversations.filter((x) => x.id !== c.id);
      if (state.current === c.id) state.current = state.conversations[0]?.id ?? null;
      save();
      render();
    };
    li.append(del);
    return li;
  }));
  const c = conversation();
  $("messages").replaceChildren(...(c ? c.messages.map(messageElement) : []));
  $("messages").scrollTop = $("messages").scrollHeight;
  const last = c?.messages.at(-1);
  $("regenerate").hidden = !(last && last.role === "assistant") || state.controller !== null;
}

function showError(text) {
  $("error").textContent = text;
  $("error").hidden = !text;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function api(path, options = {}) {
  for (let attempt = 0; attempt < 3; attempt++) {
    const response = await fetch(path, { ...options, headers: headers() });
    if (response.status !== 401) return response;
    const key = window.prompt("This server needs an API key (kept for this tab only):");
    if (!key) return response;
    sessionStorage.setItem(KEY, key.trim());
  }
  return fetch(path, { ...options, headers: headers() });
}

async function errorText(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body?.error?.message) message = `${response.status}: ${body.error.message}`;
  } catch { /* not JSON */ }
  if (response.status === 429 || response.status === 503) {
    const retry = response.headers.get("Retry-After");
    message += retry ? ` (the server is busy; retry after ${retry} s)` : " (the server is busy)";
  }
  return message;
}

async function loadModels() {
  try {
    const response = await api("v1/models");
    if (!response.ok) { showError(await errorText(response)); return; }
    const models = (await response.json()).data || [];
    $("model").replaceChildren(...models.map((m) => {
      const o = document.createElement("option");
      o.value = o.textContent = m.id;
      return o;
    }));
  } catch (e) { showError(`Cannot reach the server: ${e}`); }
}

function numberField(id) {
  const v = $(id).value.trim();
  return v === "" ? undefined : Number(v);
}

function requestBody(messages) {
  const system = $("system").value.trim();
  const body = {
    model: $("model").value || undefined,
    messages: system ? [{ role: "system", content: system }, ...messages] : messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberField("temperature"),
    top_p: numberField("top_p"),
    top_k: numberField("top_k"),
    min_p: numberField("min_p"),
    max_tokens: numberField("max_tokens"),
    seed: numberField("seed"),
  };
  const stop = $("stop").value.split("\n").map((s) => s).filter((s) => s.length > 0);
  if (stop.length) body.stop = stop;
  if ($("json-mode").checked) {
    let schema;
    try { schema = JSON.parse($("json-schema").value || "{}"); } catch (e) { throw new Error(`The JSON schema does not parse: ${e.message}`); }
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema } };
  }
  return body;
}

async function complete() {
  const c = conversation();
  const history = c.messages.map(({ role, content }) => ({ role, content }));
  const answer = { role: "assistant", content: "", stats: "" };
  c.messages.push(answer);
  render();
  const el = $("messages").lastElementChild;
  const contentEl = el.querySelector(".content");
  showError("");
  state.controller = new AbortController();
  document.body.dataset.busy = "1";
  $("stop-button").hidden = false;
  $("send").disabled = true;
  const started = performance.now();
  let firstToken = null;
  let usage = null;
  let stopped = false;
  try {
    const body = requestBody(history);
    const response = await api("v1/chat/completions", {
      method: "POST", body: JSON.stringify(body), signal: state.controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.usage) usage = chunk.usage;
          const piece = chunk.choices?.[0]?.delta?.content;
          if (piece) {
            if (firstToken === null) firstToken = performance.now();
            answer.content += piece;
            contentEl.innerHTML = renderMarkdown(answer.content);
            $("messages").scrollTop = $("messages").scrollHeight;
          }
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") stopped = true;
    else showError(e.message);
  } finally {
    const ended = performance.now();
    const tokens = usage?.completion_tokens;
    const parts = [];
    if (tokens !== undefined) parts.push(`${tokens} tokens`);
    if (tokens && firstToken !== null && ended > firstToken) {
      parts.push(`${((tokens - 1) / ((ended - firstToken) / 1000)).toFixed(1)} tok/s`);
    }
    if (firstToken !== null) parts.push(`TTFT ${Math.round(firstToken - started)} ms`);
    if (stopped) parts.push("stopped");
    answer.stats = parts.join(" · ");
    if (!answer.content && !stopped) c.messages.pop();  // an error: nothing to keep
    state.controller = null;
    document.body.dataset.busy = "0";
    $("stop-button").hidden = true;
    $("send").disabled = false;
    save();
    render();
  }
}

async function send(text) {
  if (!text.trim() || state.controller) return;
  if (!conversation()) newConversation();
  const c = conversation();
  c.messages.push({ role: "user", content: text });
  if (c.title === "New chat") c.title = text.slice(0, 40);
  save();
  await complete();
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
$("stop-button").onclick = () => state.controller?.abort();
$("regenerate").onclick = () => {
  const c = conversation();
  if (!c || state.controller || c.messages.at(-1)?.role !== "assistant") return;
  c.messages.pop();
  complete();
};
$("new-chat").onclick = newConversation;
$("json-mode").onchange = () => { $("json-schema").hidden = !$("json-mode").checked; };

state.current = state.conversations[0]?.id ?? null;
render();
loadModels();
