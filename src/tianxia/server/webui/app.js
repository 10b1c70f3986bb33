// The chat page: conversations, streamed replies, settings, the raw completion mode, the key.

import { APIError, apiKey, call, modelStatus, setApiKey, stream } from "./api.js";
import { copyText, enhance, escapeHtml, renderJson, renderMarkdown } from "./markdown.js";
import * as store from "./store.js";

const $ = (id) => document.getElementById(id);

const state = {
  settings: store.loadSettings(),
  models: [],
  conv: store.newConversation(),
  convs: [],
  controller: null, // the AbortController of the request running now, if any
};

// ---------------------------------------------------------------- status line and the key

let statusTimer = null;

function showStatus(text, isError = false) {
  const el = $("status");
  el.textContent = text;
  el.classList.toggle("error", isError);
  clearTimeout(statusTimer);
  if (text && !isError) statusTimer = setTimeout(() => (el.textContent = ""), 4000);
}

function openKeyDialog(reason) {
  $("key-reason").textContent =
    reason ||
    "This server needs an API key (its --api-key). The page keeps it in this browser and sends it with every request.";
  $("key-error").textContent = "";
  $("key-input").value = apiKey();
  if (!$("key-dialog").open) $("key-dialog").showModal();
  $("key-input").focus();
}

/** Report a failed request: a 401 asks for the key, anything else goes to the status line. */
function reportError(err) {
  if (err instanceof APIError && err.status === 401) {
    openKeyDialog(apiKey() ? `The server refused the key: ${err.message}` : undefined);
    return;
  }
  showStatus(err.message || String(err), true);
}

async function saveKey(event) {
  event.preventDefault();
  const previous = apiKey();
  setApiKey($("key-input").value.trim());
  try {
    await loadModels();
    $("key-dialog").close();
    showStatus("Key accepted.");
  } catch (err) {
    setApiKey(previous);
    $("key-error").textContent = err.message || String(err);
  }
}

// ---------------------------------------------------------------- models

/** The served models from /v1/models, with their load state where the server reports one. */
async function loadModels() {
  const body = await call("v1/models");
  state.models = body.data || [];
  const select = $("model");
  const chosen = state.settings.model;
  const shown = JSON.stringify(state.models.map((m) => [m.id, modelStatus(m)]));
  if (select.dataset.shown === shown) return; // unchanged: leave an open picker alone
  select.dataset.shown = shown;
  select.replaceChildren(
    ...state.models.map((m) => {
      const status = modelStatus(m);
      const option = new Option(status ? `${m.id} (${status.value})` : m.id, m.id);
      if (status) {
        option.dataset.status = status.value;
        if (status.reason) option.title = status.reason;
      }
      return option;
    }),
  );
  if (state.models.some((m) => m.id === chosen)) select.value = chosen;
  else if (state.models.length) state.settings.model = select.value = state.models[0].id;
  $("empty-model").textContent = select.value || "the model";
  const status = state.models.find((m) => m.id === select.value);
  select.title = status && modelStatus(status)?.reason ? modelStatus(status).reason : "";
}

function refreshModels() {
  loadModels().catch(reportError);
}

function currentModel() {
  return $("model").value || state.settings.model;
}

// ---------------------------------------------------------------- request bodies

function numberSetting(name) {
  const v = String(state.settings[name] ?? "").trim();
  if (v === "") return undefined;
  const n = Number(v);
  return Number.isFinite(n) ? n : undefined;
}

/** The sampling fields the user set; the empty ones are left to the server. */
function samplingFields() {
  const out = {};
  for (const name of ["temperature", "top_p", "top_k", "min_p", "max_tokens", "seed"]) {
    const v = numberSetting(name);
    if (v !== undefined) out[name] = v;
  }
  return out;
}

function structuredFields() {
  const s = state.settings;
  const out = {};
  if (s.response_format === "json_object") out.response_format = { type: "json_object" };
  if (s.response_format === "json_schema") {
    out.response_format = {
      type: "json_schema",
      json_schema: { name: "reply", schema: JSON.parse(s.json_schema), strict: true },
    };
  }
  if (s.tools.trim()) {
    out.tools = JSON.parse(s.tools);
    out.tool_choice = s.tool_choice;
  }
  return out;
}

function chatMessages(messages) {
  const out = [];
  if (state.settings.system.trim()) out.push({ role: "system", content: state.settings.system });
  for (const m of messages) {
    if (m.role === "assistant" && m.error && !m.content && !m.tool_calls) continue;
    const msg = { role: m.role, content: m.content };
    if (m.tool_calls && m.tool_calls.length) {
      msg.tool_calls = m.tool_calls.map((c) => ({
        id: c.id,
        type: "function",
        function: { name: c.name, arguments: c.arguments },
      }));
    }
    out.push(msg);
  }
  return out;
}

const STREAM_OPTIONS = { include_usage: true, continuous_usage_stats: true };

// ---------------------------------------------------------------- timing and token counts

class Meter {
  constructor() {
    this.start = performance.now();
    this.first = null;
    this.last = null;
    this.usage = null;
  }

  token() {
    const now = performance.now();
    if (this.first === null) this.first = now;
    this.last = now;
  }

  /** Token counts from the stream's usage; generation speed from the first to the last token. */
  stats() {
    const u = this.usage || {};
    const out = { prompt_tokens: u.prompt_tokens, completion_tokens: u.completion_tokens };
    if (this.first !== null) out.ttft = (this.first - this.start) / 1000;
    const n = u.completion_tokens;
    if (n > 1 && this.last > this.first) out.tps = ((n - 1) * 1000) / (this.last - this.first);
    return out;
  }
}

function statsText(stats, finish) {
  if (!stats) return "";
  const parts = [];
  if (stats.prompt_tokens !== undefined) parts.push(`${stats.prompt_tokens} prompt`);
  if (stats.completion_tokens !== undefined) parts.push(`${stats.completion_tokens} generated`);
  if (stats.tps !== undefined) parts.push(`${stats.tps.toFixed(1)} tokens/s`);
  if (stats.ttft !== undefined) parts.push(`first token ${stats.ttft.toFixed(2)} s`);
  if (finish === "stopped") parts.push("stopped");
  else if (finish === "length") parts.push("reached max tokens");
  else if (finish === "tool_calls") parts.push("tool call");
  return parts.join(" · ");
}

function setStatsElement(el, stats, finish) {
  el.textContent = statsText(stats, finish);
  if (stats && stats.prompt_tokens !== undefined) el.dataset.promptTokens = stats.prompt_tokens;
  if (stats && stats.completion_tokens !== undefined) {
    el.dataset.completionTokens = stats.completion_tokens;
  }
}

// ---------------------------------------------------------------- messages

function messageBody(msg) {
  const parts = [];
  if (msg.content || !(msg.tool_calls && msg.tool_calls.length)) {
    parts.push(
      msg.role === "assistant" && msg.format === "json" && msg.content
        ? renderJson(msg.content, "JSON")
        : msg.role === "assistant"
          ? renderMarkdown(msg.content)
          : `<p class="plain">${escapeHtml(msg.content)}</p>`,
    );
  }
  for (const c of msg.tool_calls || []) {
    parts.push(`<div class="tool-call">${renderJson(c.arguments || "", `tool call · ${c.name || "…"}`)}</div>`);
  }
  if (msg.error) parts.push(`<p class="error">${escapeHtml(msg.error)}</p>`);
  return parts.join("");
}

function messageElement(msg, index) {
  const el = document.createElement("article");
  el.className = `msg ${msg.role}`;
  el.dataset.index = index;
  const who = msg.role === "user" ? "You" : "Assistant";
  el.setAttribute("aria-label", who);
  const head = document.createElement("div");
  head.className = "msg-head";
  head.innerHTML = `<span class="who">${who}</span>` +
    (msg.model ? `<span class="model-name">${escapeHtml(msg.model)}</span>` : "");
  const body = document.createElement("div");
  body.className = "msg-body";
  body.innerHTML = messageBody(msg);
  enhance(body);
  const foot = document.createElement("div");
  foot.className = "msg-foot";
  const stats = document.createElement("span");
  stats.className = "stats";
  setStatsElement(stats, msg.stats, msg.finish);
  foot.append(stats);
  const actions = [["copy", "Copy"], ["edit", "Edit"]];
  if (msg.role === "assistant") actions.push(["regenerate", "Regenerate"]);
  for (const [action, label] of actions) {
    const b = document.createElement("button");
    b.type = "button";
    b.className = `msg-action ${action}`;
    b.dataset.action = action;
    b.textContent = label;
    b.setAttribute("aria-label", `${label} the ${msg.role === "user" ? "message" : "reply"}`);
    foot.append(b);
  }
  el.append(head, body, foot);
  if (msg.pending) el.setAttribute("aria-busy", "true");
  return el;
}

function nearBottom() {
  const m = $("messages");
  return m.scrollHeight - m.scrollTop - m.clientHeight < 80;
}

function scrollToBottom() {
  const m = $("messages");
  m.scrollTop = m.scrollHeight;
}

function renderMessages() {
  const list = $("messages");
  list.replaceChildren(...state.conv.messages.map(messageElement));
  $("empty").hidden = state.conv.messages.length > 0;
  scrollToBottom();
}

function updateMessage(index) {
  const old = $("messages").querySelector(`article[data-index="${index}"]`);
  const msg = state.conv.messages[index];
  if (!old || !msg) return;
  const stick = nearBottom();
  old.replaceWith(messageElement(msg, index));
  if (stick) scrollToBottom();
}

// at most one re-render of a streaming message per frame
let frame = null;
const dirty = new Set();

function scheduleUpdate(index) {
  dirty.add(index);
  if (frame === null) {
    frame = requestAnimationFrame(() => {
      frame = null;
      for (const i of dirty) updateMessage(i);
      dirty.clear();
    });
  }
}

// ---------------------------------------------------------------- conversations

async function saveConversation() {
  const conv = state.conv;
  if (!conv.messages.length) return;
  conv.updated = Date.now();
  if (!conv.title) {
    const first = conv.messages.find((m) => m.role === "user");
    conv.title = first ? first.content.trim().replace(/\s+/g, " ").slice(0, 60) : "Conversation";
  }
  await store.putConversation(conv);
  await renderConversationList();
}

async function renderConversationList() {
  state.convs = await store.listConversations();
  const list = $("conversation-list");
  list.replaceChildren(
    ...state.convs.map((c) => {
      const li = document.createElement("li");
      li.dataset.id = c.id;
      const open = document.createElement("button");
      open.type = "button";
      open.className = "conv-open";
      open.textContent = c.title || "Untitled";
      open.title = c.title;
      if (c.id === state.conv.id) open.setAttribute("aria-current", "true");
      const rename = document.createElement("button");
      rename.type = "button";
      rename.className = "conv-rename icon small";
      rename.setAttribute("aria-label", `Rename “${c.title}”`);
      rename.innerHTML = '<svg aria-hidden="true" viewBox="0 0 24 24"><path d="M4 20h4L19 9l-4-4L4 16z"/></svg>';
      const del = document.createElement("button");
      del.type = "button";
      del.className = "conv-delete icon small";
      del.setAttribute("aria-label", `Delete “${c.title}”`);
      del.innerHTML = '<svg aria-hidden="true" viewBox="0 0 24 24"><path d="M6 6l12 12M18 6L6 18"/></svg>';
      li.append(open, rename, del);
      return li;
    }),
  );
  $("no-conversations").hidden = state.convs.length > 0;
}

async function openConversation(id) {
  if (state.controller) return;
  const conv = await store.getConversation(id);
  if (!conv) return;
  state.conv = conv;
  renderMessages();
  await renderConversationList();
  closeSidebar();
  $("prompt").focus();
}

function newChat() {
  if (state.controller) return;
  state.conv = store.newConversation();
  renderMessages();
  renderConversationList();
  closeSidebar();
  $("prompt").focus();
}

function startRename(li) {
  const conv = state.convs.find((c) => c.id === li.dataset.id);
  if (!conv) return;
  const input = document.createElement("input");
  input.className = "rename-input";
  input.value = conv.title;
  input.setAttribute("aria-label", "New name");
  const open = li.querySelector(".conv-open");
  open.replaceWith(input);
  input.focus();
  input.select();
  let done = false;
  const finish = async (save) => {
    if (done) return;
    done = true;
    const title = input.value.trim();
    if (save && title) {
      conv.title = title;
      await store.putConversation(conv);
      if (state.conv.id === conv.id) state.conv.title = title;
    }
    await renderConversationList();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") finish(true);
    if (e.key === "Escape") {
      e.stopPropagation();
      finish(false);
    }
  });
  input.addEventListener("blur", () => finish(true));
}

async function deleteConv(li) {
  const conv = state.convs.find((c) => c.id === li.dataset.id);
  if (!conv || !confirm(`Delete “${conv.title}”?`)) return;
  await store.deleteConversation(conv.id);
  if (state.conv.id === conv.id) {
    if (state.controller) state.controller.abort();
    state.conv = store.newConversation();
    renderMessages();
  }
  await renderConversationList();
  showStatus("Conversation deleted.");
}

async function exportConversations() {
  const data = await store.exportAll();
  const blob = new Blob([JSON.stringify(data, null, 2)], { type: "application/json" });
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = `tianxia-conversations-${new Date().toISOString().slice(0, 10)}.json`;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

async function importConversations(file) {
  try {
    const n = await store.importData(JSON.parse(await file.text()));
    await renderConversationList();
    showStatus(`Imported ${n} conversation${n === 1 ? "" : "s"}.`);
  } catch (err) {
    showStatus(`Import failed: ${err.message}`, true);
  }
}

// ---------------------------------------------------------------- generation

function setBusy(controller) {
  state.controller = controller;
  const busy = controller !== null;
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("raw-generate").hidden = busy;
  $("raw-stop").hidden = !busy;
  $("messages").setAttribute("aria-busy", String(busy));
  if (!busy && document.activeElement && document.activeElement.hidden) $("prompt").focus();
}

function stop() {
  if (state.controller) state.controller.abort();
}

function mergeToolCalls(msg, deltas) {
  msg.tool_calls = msg.tool_calls || [];
  for (const d of deltas) {
    const i = d.index ?? msg.tool_calls.length;
    const call = (msg.tool_calls[i] = msg.tool_calls[i] || { id: "", name: "", arguments: "" });
    if (d.id) call.id = d.id;
    if (d.function && d.function.name) call.name += d.function.name;
    if (d.function && d.function.arguments) call.arguments += d.function.arguments;
  }
}

/** Stream the assistant's reply to the conversation so far into a new last message. */
async function generateReply() {
  const conv = state.conv;
  let body;
  try {
    body = {
      model: currentModel(),
      messages: chatMessages(conv.messages),
      stream_options: STREAM_OPTIONS,
      ...samplingFields(),
      ...structuredFields(),
    };
  } catch (err) {
    showStatus(`Settings: ${err.message}`, true);
    return;
  }
  const msg = { role: "assistant", content: "", model: body.model, pending: true };
  if (body.response_format) msg.format = "json";
  conv.messages.push(msg);
  const index = conv.messages.length - 1;
  renderMessages();
  const controller = new AbortController();
  setBusy(controller);
  const meter = new Meter();
  try {
    for await (const chunk of stream("v1/chat/completions", body, controller.signal)) {
      if (chunk.usage) meter.usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        if (delta.content) {
          msg.content += delta.content;
          meter.token();
        }
        if (delta.tool_calls) {
          mergeToolCalls(msg, delta.tool_calls);
          meter.token();
        }
        if (choice.finish_reason) msg.finish = choice.finish_reason;
      }
      msg.stats = meter.stats();
      scheduleUpdate(index);
    }
  } catch (err) {
    if (err.name === "AbortError") msg.finish = "stopped";
    else {
      msg.error = err.message || String(err);
      reportError(err);
    }
  } finally {
    delete msg.pending;
    msg.stats = meter.stats();
    setBusy(null);
    if (state.conv === conv) updateMessage(index);
    await saveConversation();
  }
}

async function send(text) {
  if (state.controller || !text.trim()) return;
  if (!state.models.length) {
    try {
      await loadModels();
    } catch (err) {
      reportError(err);
      return;
    }
  }
  state.conv.messages.push({ role: "user", content: text });
  $("prompt").value = "";
  await generateReply();
}

function regenerate(index) {
  if (state.controller) return;
  state.conv.messages.splice(index);
  generateReply();
}

function startEdit(article) {
  const index = Number(article.dataset.index);
  const msg = state.conv.messages[index];
  const body = article.querySelector(".msg-body");
  const form = document.createElement("form");
  form.className = "edit-form";
  const area = document.createElement("textarea");
  area.value = msg.content;
  area.rows = Math.min(12, Math.max(2, msg.content.split("\n").length));
  area.setAttribute("aria-label", "Edit the message");
  const save = document.createElement("button");
  save.type = "submit";
  save.className = "primary";
  save.textContent = msg.role === "user" ? "Send" : "Save";
  const cancel = document.createElement("button");
  cancel.type = "button";
  cancel.textContent = "Cancel";
  const row = document.createElement("div");
  row.className = "row end";
  row.append(cancel, save);
  form.append(area, row);
  body.replaceWith(form);
  article.querySelector(".msg-foot").hidden = true;
  area.focus();
  cancel.addEventListener("click", () => updateMessage(index));
  area.addEventListener("keydown", (e) => {
    if (e.key === "Escape") {
      e.stopPropagation();
      updateMessage(index);
    }
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      form.requestSubmit();
    }
  });
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    if (state.controller) return;
    msg.content = area.value;
    if (msg.role === "user") {
      // edit and resend: the turns after this one are dropped, the reply is generated anew
      state.conv.messages.splice(index + 1);
      renderMessages();
      await generateReply();
    } else {
      updateMessage(index);
      await saveConversation();
    }
  });
}

// ---------------------------------------------------------------- raw completion mode

async function generateCompletion() {
  if (state.controller) return;
  const area = $("raw-prompt");
  const prompt = area.value;
  if (!prompt) return;
  const body = {
    model: currentModel(),
    prompt,
    stream_options: STREAM_OPTIONS,
    ...samplingFields(),
  };
  const controller = new AbortController();
  setBusy(controller);
  const meter = new Meter();
  let finish = null;
  const stats = $("raw-stats");
  stats.textContent = "";
  try {
    for await (const chunk of stream("v1/completions", body, controller.signal)) {
      if (chunk.usage) meter.usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        if (choice.text) {
          area.value += choice.text;
          area.scrollTop = area.scrollHeight;
          meter.token();
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      setStatsElement(stats, meter.stats(), finish);
    }
  } catch (err) {
    if (err.name === "AbortError") finish = "stopped";
    else reportError(err);
  } finally {
    setStatsElement(stats, meter.stats(), finish);
    setBusy(null);
    state.settings.completion_prompt = area.value;
    store.saveSettings(state.settings);
  }
}

function setMode(mode) {
  state.settings.mode = mode;
  store.saveSettings(state.settings);
  $("chat-view").hidden = mode !== "chat";
  $("completion-view").hidden = mode !== "completion";
  $("mode-chat").setAttribute("aria-pressed", String(mode === "chat"));
  $("mode-completion").setAttribute("aria-pressed", String(mode === "completion"));
}

// ---------------------------------------------------------------- settings

const SETTING_FIELDS = ["system", "temperature", "top_p", "top_k", "min_p", "max_tokens", "seed",
  "response_format", "json_schema", "tools", "tool_choice"];

function fillSettingsForm(values) {
  const form = $("settings-form");
  for (const name of SETTING_FIELDS) form.elements[name].value = values[name] ?? "";
}

function saveSettingsForm(event) {
  event.preventDefault();
  const form = $("settings-form");
  const next = { ...state.settings };
  for (const name of SETTING_FIELDS) next[name] = form.elements[name].value;
  try {
    if (next.response_format === "json_schema") {
      if (!next.json_schema.trim()) throw new Error("the JSON schema is empty");
      JSON.parse(next.json_schema);
    }
    if (next.tools.trim() && !Array.isArray(JSON.parse(next.tools))) {
      throw new Error("tools must be a JSON list");
    }
  } catch (err) {
    $("settings-error").textContent = `Not saved: ${err.message}`;
    return;
  }
  state.settings = next;
  store.saveSettings(next);
  $("settings-dialog").close();
  showStatus("Settings saved.");
}

// ---------------------------------------------------------------- sidebar (phone-sized windows)

function openSidebar() {
  $("sidebar").classList.add("open");
  $("backdrop").hidden = false;
  $("open-sidebar").setAttribute("aria-expanded", "true");
  $("new-chat").focus();
}

function closeSidebar() {
  if (!$("sidebar").classList.contains("open")) return;
  $("sidebar").classList.remove("open");
  $("backdrop").hidden = true;
  $("open-sidebar").setAttribute("aria-expanded", "false");
}

// ---------------------------------------------------------------- wiring

function wire() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send($("prompt").value);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send($("prompt").value);
    }
  });
  document.querySelector(".skip").addEventListener("click", (e) => {
    e.preventDefault();
    $(state.settings.mode === "chat" ? "prompt" : "raw-prompt").focus();
  });
  $("stop").addEventListener("click", stop);
  $("raw-stop").addEventListener("click", stop);
  $("raw-generate").addEventListener("click", generateCompletion);
  $("raw-prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      generateCompletion();
    }
  });
  $("raw-prompt").addEventListener("change", () => {
    state.settings.completion_prompt = $("raw-prompt").value;
    store.saveSettings(state.settings);
  });
  document.addEventListener("keydown", (e) => {
    if (e.key !== "Escape") return;
    if (state.controller) {
      e.preventDefault();
      stop();
    } else closeSidebar();
  });

  $("messages").addEventListener("click", async (e) => {
    const copy = e.target.closest(".copy-code");
    if (copy) {
      const code = copy.closest(".code-block").querySelector("code");
      await copyText(code.textContent);
      copy.textContent = "Copied";
      setTimeout(() => (copy.textContent = "Copy"), 1500);
      return;
    }
    const button = e.target.closest("button[data-action]");
    if (!button) return;
    const article = button.closest("article");
    const index = Number(article.dataset.index);
    if (button.dataset.action === "copy") {
      await copyText(state.conv.messages[index].content);
      showStatus("Copied.");
    } else if (button.dataset.action === "edit") {
      if (!state.controller) startEdit(article);
    } else if (button.dataset.action === "regenerate") regenerate(index);
  });

  $("conversation-list").addEventListener("click", (e) => {
    const button = e.target.closest("button");
    if (!button) return;
    const li = button.closest("li");
    if (button.classList.contains("conv-open")) openConversation(li.dataset.id);
    else if (button.classList.contains("conv-rename")) startRename(li);
    else if (button.classList.contains("conv-delete")) deleteConv(li);
  });
  $("new-chat").addEventListener("click", newChat);
  $("export").addEventListener("click", exportConversations);
  $("import").addEventListener("click", () => $("import-file").click());
  $("import-file").addEventListener("change", (e) => {
    const file = e.target.files[0];
    if (file) importConversations(file);
    e.target.value = "";
  });
  $("open-sidebar").addEventListener("click", openSidebar);
  $("close-sidebar").addEventListener("click", closeSidebar);
  $("backdrop").addEventListener("click", closeSidebar);

  $("mode-chat").addEventListener("click", () => setMode("chat"));
  $("mode-completion").addEventListener("click", () => setMode("completion"));
  $("model").addEventListener("change", () => {
    state.settings.model = $("model").value;
    store.saveSettings(state.settings);
    $("empty-model").textContent = $("model").value;
  });
  // the load state of each model can change while the page is open
  $("model").addEventListener("focus", refreshModels);

  $("open-settings").addEventListener("click", () => {
    fillSettingsForm(state.settings);
    $("settings-error").textContent = "";
    $("settings-dialog").showModal();
  });
  $("settings-form").addEventListener("submit", saveSettingsForm);
  $("settings-cancel").addEventListener("click", () => $("settings-dialog").close());
  $("settings-reset").addEventListener("click", () => fillSettingsForm(store.DEFAULT_SETTINGS));

  $("open-key").addEventListener("click", () => openKeyDialog());
  $("key-form").addEventListener("submit", saveKey);
  $("key-cancel").addEventListener("click", () => $("key-dialog").close());
  $("key-forget").addEventListener("click", () => {
    setApiKey("");
    $("key-input").value = "";
    $("key-dialog").close();
    showStatus("Key forgotten.");
  });
}

async function main() {
  wire();
  setMode(state.settings.mode);
  $("raw-prompt").value = state.settings.completion_prompt;
  renderMessages();
  await renderConversationList();
  if (state.convs.length) await openConversation(state.convs[0].id);
  refreshModels();
  document.body.dataset.ready = "true";
}

main();
