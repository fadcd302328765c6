// The chat playground: a conversation over /v1/responses (stored, run in the
// background and streamed, so Stop can cancel it by id), with the lifecycle viewer
// one link away from each reply.

import { Api } from "./api.js";
import { lastResponseId, loadConversations, newConversation, saveConversations } from "./conversations.js";
import { renderMarkdown } from "./markdown.js";
import { startEngineStrip } from "./strip.js";
import { showLifecycle } from "./viewer.js";

const $ = (id) => document.getElementById(id);
const FINAL = new Set(["completed", "incomplete", "failed", "cancelled"]);
const SETTINGS_NAME = "sluice.settings";
const SETTING_FIELDS = ["system", "temperature", "top-p", "max-tokens", "json-schema", "tools"];

const api = new Api(askKey);
const nodes = new WeakMap(); // message -> its <article>
let model = null;
let conversations = loadConversations();
let current = null;
let running = null; // { reply, stopRequested }

function element(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// ------------------------------------------------------------------ the API key

function askKey(reason) {
  const dialog = $("key-dialog");
  $("key-reason").textContent = `${reason} Enter a key this server accepts.`;
  if (!dialog.open) dialog.showModal();
  $("api-key").focus();
  return new Promise((resolve) => {
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      dialog.close();
      resolve($("api-key").value.trim());
    }, { once: true });
  });
}

// ------------------------------------------------------------------ model card

async function loadModel() {
  for (;;) {
    try {
      model = (await api.json("GET", "/v1/models")).data[0];
      break;
    } catch (error) {
      $("model-card").textContent = error.status === 503
        ? "The server is loading its model…" : `Cannot read the model card: ${error.message}`;
      await sleep(2000);
    }
  }
  const card = $("model-card");
  card.replaceChildren(element("strong", model.id, "model-id"));
  const facts = [
    ["architecture", model.architecture],
    ["context", model.max_model_len],
    ["quantization", model.quantization],
    ["template", model.chat_template],
    ["tool parser", model.tool_call_parser],
    ["reasoning parser", model.reasoning_parser],
  ];
  for (const [name, value] of facts) {
    if (value !== undefined && value !== null) card.append(element("span", `${name}: ${value}`, "fact"));
  }
}

// ------------------------------------------------------------------ settings

function restoreSettings() {
  let kept = {};
  try {
    kept = JSON.parse(localStorage.getItem(SETTINGS_NAME) || "{}");
  } catch {
    kept = {};
  }
  for (const id of SETTING_FIELDS) {
    if (typeof kept[id] === "string") $(id).value = kept[id];
    $(id).addEventListener("change", () => {
      const values = Object.fromEntries(SETTING_FIELDS.map((name) => [name, $(name).value]));
      localStorage.setItem(SETTINGS_NAME, JSON.stringify(values));
    });
  }
}

function parseJsonField(id, what) {
  const text = $(id).value.trim();
  if (!text) return null;
  try {
    return JSON.parse(text);
  } catch (error) {
    throw new Error(`${what} is not valid JSON: ${error.message}`);
  }
}

// The request's parameters from the form; an Error names the field that is wrong.
function requestParameters() {
  const parameters = {};
  const system = $("system").value.trim();
  if (system) parameters.instructions = system;
  for (const [id, name] of [["temperature", "temperature"], ["top-p", "top_p"], ["max-tokens", "max_output_tokens"]]) {
    const raw = $(id).value.trim();
    if (!raw) continue;
    const value = Number(raw);
    if (!Number.isFinite(value)) throw new Error(`${name} must be a number`);
    parameters[name] = value;
  }
  const schema = parseJsonField("json-schema", "The JSON schema");
  if (schema !== null) {
    parameters.text = { format: { type: "json_schema", name: "page_schema", schema, strict: true } };
  }
  const tools = parseJsonField("tools", "Tools");
  if (tools !== null) {
    if (!Array.isArray(tools)) throw new Error("Tools must be a JSON array");
    parameters.tools = tools;
  }
  return parameters;
}

// ------------------------------------------------------------------ conversations

function save() {
  saveConversations(conversations);
}

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren();
  for (const conversation of [...conversations].sort((a, b) => b.created - a.created)) {
    const link = element("a", conversation.title);
    link.href = `#/c/${conversation.id}`;
    if (current && conversation.id === current.id) link.setAttribute("aria-current", "page");
    const item = element("li");
    item.append(link);
    list.append(item);
  }
}

function statsLine(message) {
  const line = element("p", null, "stats");
  const { stats = {} } = message;
  const parts = [];
  if (stats.ttft_ms !== undefined) parts.push(`TTFT ${stats.ttft_ms} ms`);
  if (stats.tokens_per_s !== undefined) parts.push(`${stats.tokens_per_s.toFixed(1)} tok/s`);
  if (stats.input_tokens !== undefined) parts.push(`${stats.input_tokens} in`);
  if (stats.output_tokens !== undefined) parts.push(`${stats.output_tokens} out`);
  if (message.status) parts.push(message.status);
  line.append(element("span", parts.join(" · ")));
  line.dataset.status = message.status || "";
  if (message.responseId) {
    const link = element("a", "lifecycle");
    link.href = `#/responses/${message.responseId}`;
    link.className = "lifecycle-link";
    line.append(" · ", link);
  }
  return line;
}

function functionCallNode(message, call) {
  const box = element("div", null, "item function-call");
  box.append(element("p", `Function call: ${call.name}(${call.arguments})`, "call"));
  if (call.answered) return box;
  const form = element("form", null, "call-output");
  const label = element("label", "Output ");
  const input = element("input");
  input.required = true;
  label.append(input);
  form.append(label, element("button", "Send output"));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    call.answered = true;
    send([{ type: "function_call_output", call_id: call.call_id, output: input.value }],
         { role: "tool", text: `${call.name} → ${input.value}` });
  });
  box.append(form);
  return box;
}

function messageNode(message) {
  const node = element("article", null, `message ${message.role}`);
  node.dataset.role = message.role;
  // Screen readers announce the reply once it is whole, not at every redraw.
  if (message.role === "assistant" && !FINAL.has(message.status)) node.setAttribute("aria-busy", "true");
  const who = { user: "You", assistant: model ? model.id : "Model", tool: "Function output" }[message.role];
  node.append(element("p", who, "who"));
  if (message.reasoning) {
    const details = element("details", null, "reasoning");
    details.append(element("summary", "Reasoning"), element("div", message.reasoning));
    node.append(details);
  }
  const body = element("div", null, "body");
  if (message.role !== "assistant") {
    body.textContent = message.text;
  } else if (message.format === "json") {
    const pre = element("pre");
    pre.append(element("code", message.text));
    body.append(pre);
  } else {
    body.append(renderMarkdown(message.text));
  }
  node.append(body);
  for (const call of message.calls || []) node.append(functionCallNode(message, call));
  if (message.error) node.append(element("p", message.error, "error"));
  if (message.role === "assistant") node.append(statsLine(message));
  return node;
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  if (!current || !current.messages.length) {
    box.append(element("p", "Start a conversation below.", "muted"));
    return;
  }
  for (const message of current.messages) {
    const node = messageNode(message);
    nodes.set(message, node);
    box.append(node);
  }
}

let pending = new Set();
function renderSoon(message) {
  if (!pending.size) {
    requestAnimationFrame(() => {
      // Follow the text as it grows, unless the reader scrolled up to read.
      const atEnd = window.innerHeight + window.scrollY >= document.body.scrollHeight - 40;
      for (const m of pending) {
        const old = nodes.get(m);
        if (!old || !old.isConnected) continue;
        const node = messageNode(m);
        nodes.set(m, node);
        old.replaceWith(node);
      }
      pending = new Set();
      if (atEnd) window.scrollTo(0, document.body.scrollHeight);
    });
  }
  pending.add(message);
}

// ------------------------------------------------------------------ one turn

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function finish(reply, response) {
  reply.status = response.status;
  const usage = response.usage;
  if (usage) {
    reply.stats.input_tokens = usage.input_tokens;
    reply.stats.output_tokens = usage.output_tokens;
  }
  if (response.error) reply.error = response.error.message;
}

async function send(input, userMessage) {
  let parameters;
  try {
    parameters = requestParameters();
    $("settings-error").textContent = "";
  } catch (error) {
    $("settings-error").textContent = error.message;
    $("settings").open = true;
    return;
  }
  if (!current) {
    current = newConversation();
    conversations.push(current);
    history.replaceState(null, "", `#/c/${current.id}`);
  }
  const previous = lastResponseId(current);
  if (current.title === "New chat" && userMessage.role === "user") current.title = userMessage.text.slice(0, 48);
  const reply = { role: "assistant", text: "", reasoning: "", calls: [], status: "", stats: {},
                  format: parameters.text ? "json" : "text" };
  current.messages.push(userMessage, reply);
  save();
  renderSidebar();
  renderMessages();
  running = { reply, stopRequested: false };
  setBusy(true);
  const body = { model: model.id, input, store: true, background: true, stream: true, ...parameters };
  if (previous) body.previous_response_id = previous;
  const sent = performance.now();
  let first = null;
  let last = null;
  let deltas = 0;
  try {
    for await (const event of api.stream("/v1/responses", body)) {
      switch (event.type) {
        case "response.created":
          reply.responseId = event.response.id;
          reply.status = event.response.status;
          save();
          if (running.stopRequested) cancel(reply);
          break;
        case "response.queued":
        case "response.in_progress":
          reply.status = event.response.status;
          break;
        case "response.output_text.delta":
        case "response.reasoning_text.delta":
          last = performance.now();
          if (first === null) {
            first = last;
            reply.stats.ttft_ms = Math.round(first - sent);
          }
          deltas += 1;
          if (event.type === "response.output_text.delta") reply.text += event.delta;
          else reply.reasoning += event.delta;
          break;
        case "response.output_item.done":
          if (event.item.type === "function_call") {
            const { call_id, name, arguments: args } = event.item;
            reply.calls.push({ call_id, name, arguments: args });
          }
          break;
        case "response.completed":
        case "response.incomplete":
        case "response.failed":
          finish(reply, event.response);
          save(); // kept as soon as it shows as done: a reload before the stream closes keeps it
          break;
        case "error":
          reply.error = event.message;
          break;
        default:
          break;
      }
      renderSoon(reply);
    }
    if (reply.responseId && !FINAL.has(reply.status)) {
      // A cancelled stream just ends: the stored response has the final word.
      finish(reply, await api.json("GET", `/v1/responses/${reply.responseId}`));
    }
  } catch (error) {
    reply.error = error.message;
    if (!reply.status) reply.status = "failed";
  }
  const tokens = reply.stats.output_tokens ?? deltas;
  if (first !== null && last > first && tokens > 1) {
    reply.stats.tokens_per_s = ((tokens - 1) * 1000) / (last - first);
  }
  running = null;
  setBusy(false);
  save();
  renderSoon(reply);
}

async function cancel(reply) {
  try {
    await api.json("POST", `/v1/responses/${reply.responseId}/cancel`);
  } catch (error) {
    // 400: it finished before the cancel arrived; anything else is worth showing.
    if (error.status !== 400) reply.error = error.message;
  }
}

function stop() {
  if (!running) return;
  running.stopRequested = true;
  $("stop").disabled = true;
  if (running.reply.responseId) cancel(running.reply);
}

// ------------------------------------------------------------------ views

async function refreshUnfinished(conversation) {
  for (const message of conversation.messages) {
    if (!message.responseId || FINAL.has(message.status) || (running && running.reply === message)) continue;
    try {
      finish(message, await api.json("GET", `/v1/responses/${message.responseId}`));
      renderSoon(message);
    } catch {
      // deleted on the server: the kept text is all there is
    }
  }
  save();
}

async function route() {
  const viewed = /^#\/responses\/([\w-]+)$/.exec(location.hash);
  $("chat-view").hidden = Boolean(viewed);
  $("viewer-view").hidden = !viewed;
  if (viewed) {
    const back = current ? `#/c/${current.id}` : "#/";
    try {
      await showLifecycle(api, viewed[1], $("viewer-view"), back);
    } catch (error) {
      $("viewer-view").replaceChildren(element("p", `Cannot show ${viewed[1]}: ${error.message}`, "error"));
    }
    return;
  }
  const chosen = /^#\/c\/([\w-]+)$/.exec(location.hash);
  const latest = [...conversations].sort((a, b) => b.created - a.created)[0] || null;
  current = (chosen && conversations.find((c) => c.id === chosen[1])) || current || latest;
  renderSidebar();
  renderMessages();
  if (current) refreshUnfinished(current);
}

function startNewChat() {
  if (running) return;
  current = null;
  history.replaceState(null, "", "#/");
  renderSidebar();
  renderMessages();
  $("prompt").focus();
}

function submitPrompt(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || running || !model) return;
  $("prompt").value = "";
  send(text, { role: "user", text });
}

async function main() {
  restoreSettings();
  $("composer").addEventListener("submit", submitPrompt);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) submitPrompt(event);
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", startNewChat);
  $("key-dialog").addEventListener("cancel", (event) => event.preventDefault());
  document.querySelector(".skip").addEventListener("click", (event) => {
    event.preventDefault(); // not a route: focus the box without touching the URL
    $("prompt").focus();
  });
  window.addEventListener("hashchange", route);
  startEngineStrip($("engine-strip"));
  await loadModel();
  await route();
  document.body.dataset.ready = "true";
}

main();
