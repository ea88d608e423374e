// dsaserve web console: the Deploy panel (the planner's /api/plan routes) and the Playground
// (a chat against this server's /v1/chat/completions). Plain ES module, no build step, nothing
// fetched from elsewhere. Model output is only ever set as text (textContent), never as HTML.

const $ = (selector, root = document) => root.querySelector(selector);
const $$ = (selector, root = document) => [...root.querySelectorAll(selector)];

/** Create an element: props are set as properties (`className`, `textContent`, `title`...)
 * or, for `data-*`/`aria-*`, as attributes; string children become text nodes. */
function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key.startsWith("data-") || key.startsWith("aria-")) node.setAttribute(key, value);
    else node[key] = value;
  }
  for (const child of children) {
    if (child !== null && child !== undefined) node.append(child);
  }
  return node;
}

const GIB = 2 ** 30;
const gib = (bytes) => `${(bytes / GIB).toFixed(1)} GiB`;
const num = (n) => Number(n).toLocaleString("en-US");
const AXES = ["model", "hardware", "recipe", "nodes"];
const RECIPE_LABELS = {
  "low-latency": "Low-Latency", balanced: "Balanced", "high-throughput": "High-Throughput",
};

const app = {
  config: { chat: false, api_key_required: false },
  options: null,
  defaults: {},
  rules: {},
  matrix: new Map(),
  lastPlan: null,
  flavour: "dsaserve",
  tab: "deploy",
  planSeq: 0,
  matrixSeq: 0,
  modelId: null,
};

// ------------------------------------------------------------------ small helpers

function debounce(fn, ms) {
  let timer = null;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn(...args), ms);
  };
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
    flash(button, "Copied");
  } catch {
    flash(button, "Select and copy");
  }
}

function flash(button, text) {
  const before = button.dataset.label || button.textContent;
  button.dataset.label = before;
  button.textContent = text;
  setTimeout(() => { button.textContent = before; }, 1200);
}

function authHeaders() {
  const key = $("#k-api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function getJSON(url, init = {}) {
  const response = await fetch(url, init);
  let body = null;
  try {
    body = await response.json();
  } catch {
    body = null;
  }
  return { status: response.status, ok: response.ok, body, headers: response.headers };
}

// ------------------------------------------------------------------ URL state

function readHash() {
  const text = location.hash.replace(/^#/, "");
  const [tab, query = ""] = text.split("?");
  return { tab: tab === "playground" ? "playground" : "deploy", params: new URLSearchParams(query) };
}

function writeHash() {
  const request = readForm();
  const params = new URLSearchParams();
  for (const [key, value] of Object.entries(request)) {
    if (AXES.includes(key) || value !== app.defaults[key]) params.set(key, value ?? "");
  }
  history.replaceState(null, "", `#${app.tab}?${params}`);
}

function setTab(tab) {
  app.tab = tab;
  for (const button of $$(".tabs [data-tab]")) {
    button.setAttribute("aria-selected", String(button.dataset.tab === tab));
  }
  $("#panel-deploy").hidden = tab !== "deploy";
  $("#panel-playground").hidden = tab !== "playground";
  writeHash();
}

// ------------------------------------------------------------------ the Deploy form

function modelEntry(name) {
  return app.options.models.find((m) => m.name === name);
}

function buildForm() {
  const { options } = app;
  const bases = [...new Set(options.models.map((m) => m.base))];
  $("#f-base").replaceChildren(...bases.map((b) => el("option", { value: b, textContent: b })));
  const precisions = [...new Set(options.models.map((m) => m.precision))];
  $("#f-precision").replaceChildren(
    ...precisions.map((p) => el("option", { value: p, textContent: p.toUpperCase() })),
  );
  $("#f-hardware").replaceChildren(...options.hardware.map((hw) => el("option", {
    value: hw.name, "data-label": hardwareLabel(hw), textContent: hardwareLabel(hw),
  })));
  const nodes = [el("option", { value: "", "data-label": "auto (fewest that fit)",
    textContent: "auto (fewest that fit)" })];
  for (const n of options.nodes) {
    nodes.push(el("option", { value: String(n), "data-label": String(n), textContent: String(n) }));
  }
  $("#f-nodes").replaceChildren(...nodes);
  $("#f-recipe").replaceChildren(...options.recipes.map((r) => el("label", { className: "recipe" },
    el("input", { type: "radio", name: "recipe", value: r }),
    el("span", { textContent: RECIPE_LABELS[r] || r }))));
  for (const select of $$("select[data-choices]")) {
    const values = options.choices[select.dataset.choices];
    const items = select.dataset.none ? [el("option", { value: "", textContent: select.dataset.none })] : [];
    for (const v of values) items.push(el("option", { value: v, textContent: v }));
    select.replaceChildren(...items);
  }
}

function hardwareLabel(hw) {
  return hw.vendor === "cpu" ? "CPU (host memory)"
    : `${hw.name} · ${hw.gpus_per_node}× ${hw.memory_gib} GiB`;
}

function readForm() {
  const form = $("#plan-form");
  const value = (name) => form.elements[name].value;
  const base = value("base");
  const precision = value("precision");
  const model = app.options.models.find((m) => m.base === base && m.precision === precision)
    || app.options.models.find((m) => m.base === base);
  const recipe = $("#f-recipe input:checked");
  const intOr = (name, fallback) => (value(name) === "" ? fallback : parseInt(value(name), 10));
  return {
    model: model.name,
    hardware: value("hardware"),
    recipe: recipe ? recipe.value : app.defaults.recipe,
    nodes: value("nodes") === "" ? null : parseInt(value("nodes"), 10),
    pd: value("pd") || null,
    pd_transfer_backend: value("pd_transfer_backend"),
    hicache: form.elements.hicache.checked,
    hicache_write_policy: value("hicache_write_policy"),
    hicache_storage: value("hicache_storage") || null,
    context_parallel: value("context_parallel") || null,
    dp_attention: value("dp_attention"),
    reasoning_parser: form.elements.reasoning_parser.checked,
    tool_call_parser: form.elements.tool_call_parser.checked,
    speculative: value("speculative"),
    kv_cache_dtype: value("kv_cache_dtype"),
    input_len: intOr("input_len", app.defaults.input_len),
    output_len: intOr("output_len", app.defaults.output_len),
    mem_fraction_static: value("mem_fraction_static") === "" ? null
      : parseFloat(value("mem_fraction_static")),
  };
}

function writeForm(request) {
  const form = $("#plan-form");
  const model = modelEntry(request.model) || modelEntry(app.defaults.model);
  form.elements.base.value = model.base;
  form.elements.precision.value = model.precision;
  for (const [key, value] of Object.entries(request)) {
    const field = form.elements[key];
    if (!field || AXES.includes(key) && key !== "hardware" && key !== "nodes") continue;
    if (field.type === "checkbox") field.checked = Boolean(value);
    else field.value = value ?? "";
  }
  for (const radio of $$("#f-recipe input")) radio.checked = radio.value === request.recipe;
}

/** The request a URL describes: the defaults, overridden by its query parameters. */
function requestFromParams(params) {
  const request = { ...app.defaults };
  for (const [key, text] of params) {
    if (!(key in app.defaults) || key === "device_memory_gib") continue;
    const fallback = app.defaults[key];
    if (typeof fallback === "boolean") request[key] = text === "true";
    else if (["nodes", "input_len", "output_len", "port"].includes(key)) {
      request[key] = text === "" ? null : parseInt(text, 10);
    } else if (key === "mem_fraction_static") request[key] = text === "" ? null : parseFloat(text);
    else request[key] = text === "" && fallback === null ? null : text;
  }
  return request;
}

// ------------------------------------------------------------------ planning

async function planNow() {
  const seq = ++app.planSeq;
  const request = readForm();
  const answer = await getJSON("/api/plan", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(request),
  });
  if (seq !== app.planSeq) return; // a newer answer is on its way
  app.lastPlan = answer.body;
  renderPlan(answer);
  markOptions();
}

function renderPlan(answer) {
  const body = answer.body || {};
  const error = $("#plan-error");
  const refusal = $("#plan-refusal");
  error.hidden = answer.status !== 400;
  refusal.hidden = !(answer.status === 200 && body.ok === false);
  document.body.dataset.plan = body.ok ? "ok" : answer.status === 400 ? "invalid" : "refused";
  if (answer.status === 400 || !answer.body) {
    const e = body.error || { message: `HTTP ${answer.status}` };
    error.textContent = `${e.type || "error"}: ${e.message}${e.param ? ` (${e.param})` : ""}`;
    $("#plan-headline").textContent = "Invalid input";
    clearPlan();
    return;
  }
  if (!body.ok) {
    renderRefusal(body);
    clearPlan();
    return;
  }
  $("#plan-headline").textContent = headline(body);
  renderCommands(body.commands);
  renderMemory(body.memory);
  renderRules(body.rules);
}

function clearPlan() {
  $("#plan-commands").replaceChildren();
  $("#plan-memory").replaceChildren();
  $("#plan-rules").replaceChildren();
}

function headline(body) {
  const lay = body.layout;
  if (!lay) return "PD router in front of one prefill and one decode worker";
  let parallel = `TP${lay.tp}`;
  if (lay.dp_attention) parallel += `, DP-attention DP${lay.dp}`;
  if (lay.ep > 1) parallel += `, EP${lay.ep}${lay.moe_a2a_backend ? ` (${lay.moe_a2a_backend})` : ""}`;
  const spec = lay.speculative || "no speculative decoding";
  const where = `${lay.nodes} × ${lay.gpus_per_node} × ${lay.hardware}`;
  return `${lay.model} (${lay.precision.toUpperCase()}) on ${where}, ${body.request.recipe}: `
    + `${parallel}, ${spec}, KV ${lay.kv_cache_dtype}`;
}

function renderRefusal(body) {
  $("#plan-headline").textContent = "This layout cannot work";
  const statement = app.rules[body.rule] || "";
  $(".refusal-rule", $("#plan-refusal")).replaceChildren(
    "Refused by ", el("code", { className: "rule-name", textContent: body.rule }),
    statement ? el("span", { className: "rule-text", textContent: ` — ${statement}` }) : null,
  );
  $(".refusal-reason").textContent = body.reason;
  const near = body.nearest;
  $(".refusal-nearest").hidden = !near;
  if (near) $(".nearest-plan").textContent = near.plan;
}

function useNearest() {
  const near = app.lastPlan && app.lastPlan.nearest;
  if (!near) return;
  writeForm({ ...readForm(), ...near.request });
  formChanged(true);
}

function commandLabel(command, body) {
  const multi = body.layout && body.layout.nodes > 1 && command.role !== "router";
  return `# ${command.role}${multi ? ` on node ${command.node_rank}` : ""}`;
}

function renderCommands(commands) {
  const blocks = commands.map((command) => {
    const line = app.flavour === "sglang" ? command.sglang : command.dsaserve;
    const copy = el("button", { type: "button", className: "copy", textContent: "Copy" });
    copy.addEventListener("click", () => copyText(line, copy));
    return el("div", { className: "command", "data-role": command.role },
      el("div", { className: "command-head" },
        el("span", { className: "command-label", textContent: commandLabel(command, app.lastPlan) }),
        copy),
      el("pre", {}, el("code", { textContent: line })));
  });
  $("#plan-commands").replaceChildren(...blocks);
}

function renderMemory(memory) {
  const box = $("#plan-memory");
  if (!memory) {
    box.replaceChildren();
    return;
  }
  const m = memory;
  const mtp = m.params_mtp ? ` + MTP ${(m.params_mtp / 1e9).toFixed(2)} B` : "";
  const served = m.kv_bytes_per_token_served !== m.kv_bytes_per_token
    ? `; ${num(m.kv_bytes_per_token_served)} B with the MTP layer` : "";
  const rows = [
    ["parameters", `${(m.params_main / 1e9).toFixed(1)} B main${mtp}, ${m.precision.toUpperCase()}: `
      + `${(m.weight_bytes_total / 1e9).toFixed(1)} GB of weights`],
    ["weights per GPU", `${gib(m.weight_bytes_per_gpu)} of ${gib(m.device_bytes)}; `
      + `--mem-fraction-static ${m.mem_fraction_static} → ${gib(m.budget_bytes_per_gpu)}`],
    ["KV pool per GPU", gib(m.kv_pool_bytes_per_gpu)],
    ["KV per token", `${num(m.kv_bytes_per_token)} B (${m.kv_dtype})${served}`],
    ["tokens that fit", `${num(m.tokens_per_rank)} per KV pool × ${m.kv_ranks} = ${num(m.total_tokens)}`],
    ["concurrency", `${num(m.concurrency)} requests of ${num(m.tokens_per_request)} tokens`],
  ];
  if (m.kv_bytes_per_token_layer_split) {
    const share = Math.round((100 * m.kv_bytes_per_token_layer_split) / m.kv_bytes_per_token_served);
    rows.push(["KV, LayerSplit", `${num(m.kv_bytes_per_token_layer_split)} B per token per CP rank `
      + `(${share}%, ${m.cp_size} ranks) with --enable-dsa-cache-layer-split (pool not sized up for it)`]);
  }
  if (m.hicache_host_bytes_per_gpu) rows.push(["HiCache host", `${gib(m.hicache_host_bytes_per_gpu)} per GPU`]);
  const table = el("table", { className: "fit" }, ...rows.map(([name, value]) => el("tr", {},
    el("th", { textContent: name }), el("td", { textContent: value }))));
  const pct = (bytes) => `${Math.max(0, (100 * bytes) / m.device_bytes).toFixed(2)}%`;
  const bar = el("div", { className: "fit-bar", title: "device memory per GPU" },
    el("span", { className: "seg weights", title: `weights ${gib(m.weight_bytes_per_gpu)}` }),
    el("span", { className: "seg kv", title: `KV pool ${gib(m.kv_pool_bytes_per_gpu)}` }));
  bar.children[0].style.width = pct(m.weight_bytes_per_gpu);
  bar.children[1].style.width = pct(m.kv_pool_bytes_per_gpu);
  const legend = el("div", { className: "fit-legend" },
    el("span", { className: "key weights", textContent: "weights" }),
    el("span", { className: "key kv", textContent: "KV pool" }),
    el("span", { className: "key reserve", textContent: "reserve (activations, graphs)" }));
  box.replaceChildren(el("h3", { textContent: "Memory fit" }), bar, legend, table);
}

function renderRules(rules) {
  const items = rules.map((r) => el("li", {},
    el("code", { className: "rule-name", textContent: r.name }),
    el("span", { className: "rule-detail", textContent: r.detail }),
    el("div", { className: "rule-text", textContent: r.text })));
  $("#plan-rules").replaceChildren(
    el("h3", { textContent: "Rules applied" }), el("ul", { className: "rule-list" }, ...items));
}

// ------------------------------------------------------------------ the refusal matrix

async function refreshMatrix() {
  const seq = ++app.matrixSeq;
  const request = readForm();
  const params = new URLSearchParams();
  for (const [key, value] of Object.entries(request)) {
    if (!AXES.includes(key) && value !== app.defaults[key]) params.set(key, value ?? "");
  }
  const answer = await getJSON(`/api/plan/matrix?${params}`);
  if (seq !== app.matrixSeq || !answer.ok) return;
  app.matrix = new Map(answer.body.cells.map((c) => [cellKey(c), c]));
  markOptions();
}

function cellKey(cell) {
  return [cell.model, cell.hardware, cell.recipe, cell.nodes ?? ""].join("|");
}

function mark(node, cell, label) {
  const refused = cell && !cell.ok;
  node.classList.toggle("refused", Boolean(refused));
  node.title = refused ? `refused by ${cell.rule}: ${cell.reason}` : "";
  if (label !== undefined) node.textContent = refused ? `${label} — refused (${cell.rule})` : label;
}

function markOptions() {
  if (!app.matrix.size) return;
  const r = readForm();
  const cell = (over) => {
    const c = { ...r, ...over };
    return app.matrix.get(cellKey(c));
  };
  for (const option of $("#f-hardware").options) {
    mark(option, cell({ hardware: option.value }), option.dataset.label);
  }
  for (const option of $("#f-nodes").options) {
    mark(option, cell({ nodes: option.value === "" ? null : Number(option.value) }), option.dataset.label);
  }
  const base = $("#f-base").value;
  for (const option of $("#f-precision").options) {
    const model = app.options.models.find((m) => m.base === base && m.precision === option.value);
    option.disabled = !model;
    mark(option, model ? cell({ model: model.name }) : null, option.value.toUpperCase());
  }
  for (const label of $$("#f-recipe label")) {
    mark(label, cell({ recipe: $("input", label).value }));
  }
}

function formChanged(features) {
  writeHash();
  schedulePlan();
  if (features) scheduleMatrix();
}

const schedulePlan = debounce(planNow, 120);
const scheduleMatrix = debounce(refreshMatrix, 250);

// ------------------------------------------------------------------ the status strip

async function refreshStatus() {
  const strip = $("#status-strip");
  if (!app.config.chat) {
    strip.replaceChildren(el("span", { className: "pill", textContent: "planner only (no model)" }));
    return;
  }
  if (app.config.api_key_required && !$("#k-api-key").value.trim()) {
    strip.replaceChildren(el("span", { className: "pill warn", textContent: "API key needed" }));
    return;
  }
  try {
    const answer = await getJSON("/get_server_info", { headers: authHeaders() });
    if (!answer.ok) {
      const message = answer.body && answer.body.error ? answer.body.error.message : "";
      strip.replaceChildren(el("span", { className: "pill warn",
        textContent: `server: HTTP ${answer.status} ${message}` }));
      return;
    }
    renderStatus(answer.body);
  } catch {
    strip.replaceChildren(el("span", { className: "pill warn", textContent: "server unreachable" }));
  }
}

function renderStatus(info) {
  const stats = (info.internal_states && info.internal_states[0]) || {};
  const model = info.served_model_name || String(info.model_path || "").split("/").pop();
  app.modelId = model;
  const kv = stats.kv_total_tokens ? `${num(stats.kv_used_tokens || 0)} / ${num(stats.kv_total_tokens)}`
    : stats.kv_used_tokens !== undefined ? num(stats.kv_used_tokens) : "–";
  const items = [
    ["model", model],
    ["parsers", `${info.resolved_reasoning_parser || "none"} · ${info.resolved_tool_call_parser || "none"}`],
    ["context", info.context_length ? num(info.context_length) : "–"],
    ["running", String(stats.num_running ?? "–")],
    ["waiting", String(stats.num_waiting ?? "–")],
    ["KV", kv],
  ];
  if (info.draining) items.push(["state", "draining"]);
  $("#status-strip").replaceChildren(...items.map(([k, v]) => el("span", { className: "pill",
    "data-key": k }, el("b", { textContent: `${k} ` }), v)));
}

function pollStatus() {
  refreshStatus().finally(() => setTimeout(pollStatus, 2000));
}

// ------------------------------------------------------------------ the Playground

const chat = { history: [], controller: null, turn: null };

const SAMPLE_TOOLS = [{
  type: "function",
  function: {
    name: "get_weather",
    description: "Current weather and a forecast for a city",
    parameters: {
      type: "object",
      properties: {
        location: { type: "string", description: "city name" },
        days: { type: "integer", description: "forecast days" },
      },
      required: ["location"],
    },
  },
}];

function numberKnob(id, parse = parseFloat) {
  const text = $(id).value.trim();
  return text === "" ? undefined : parse(text);
}

/** The tools field as JSON; throws with a readable message when it is not. */
function toolsKnob() {
  const text = $("#k-tools").value.trim();
  if (!text) return undefined;
  const tools = JSON.parse(text);
  if (!Array.isArray(tools)) throw new Error("tools must be a JSON array");
  return tools;
}

function buildRequest(prompt) {
  const messages = [];
  const system = $("#k-system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...chat.history);
  if (prompt !== null) messages.push({ role: "user", content: prompt });
  const body = { model: app.modelId || "default", messages, stream: true,
    stream_options: { include_usage: true } };
  const kwargs = { enable_thinking: $("#k-thinking").checked };
  if ($("#k-clear-thinking").checked) kwargs.clear_thinking = true;
  body.chat_template_kwargs = kwargs;
  if ($("#k-effort").value) body.reasoning_effort = $("#k-effort").value;
  const knobs = {
    temperature: numberKnob("#k-temperature"), top_p: numberKnob("#k-top-p"),
    top_k: numberKnob("#k-top-k", (t) => parseInt(t, 10)), min_p: numberKnob("#k-min-p"),
    seed: numberKnob("#k-seed", (t) => parseInt(t, 10)),
    max_tokens: numberKnob("#k-max-tokens", (t) => parseInt(t, 10)),
  };
  for (const [key, value] of Object.entries(knobs)) if (value !== undefined) body[key] = value;
  const stop = $("#k-stop").value.split("\n").filter((s) => s !== "");
  if (stop.length) body.stop = stop;
  const tools = toolsKnob();
  if (tools) body.tools = tools;
  const choice = $("#k-tool-choice").value;
  if (choice.startsWith("function:")) {
    body.tool_choice = { type: "function", function: { name: choice.slice(9) } };
  } else if (choice) body.tool_choice = choice;
  return body;
}

/** tool_choice offers auto/none/required and each function named in the tools field. */
function updateToolChoices() {
  const select = $("#k-tool-choice");
  let names = [];
  try {
    names = (toolsKnob() || []).map((t) => t.function && t.function.name).filter(Boolean);
  } catch {
    names = [];
  }
  const keep = select.value;
  const values = ["", "auto", "none", "required", ...names.map((n) => `function:${n}`)];
  select.replaceChildren(...values.map((v) => el("option", { value: v,
    textContent: v === "" ? "(default)" : v.startsWith("function:") ? `function ${v.slice(9)}` : v })));
  select.value = values.includes(keep) ? keep : "";
}

function shellQuote(text) {
  return `'${text.replaceAll("'", "'\\''")}'`;
}

function curlCommand(body) {
  // the key stays out of the snippet: the shell expands $DSASERVE_API_KEY
  const key = $("#k-api-key").value.trim() ? ["-H", '"Authorization: Bearer $DSASERVE_API_KEY"'] : [];
  const parts = ["curl", "-N", shellQuote(`${location.origin}/v1/chat/completions`),
    "-H", shellQuote("Content-Type: application/json"), ...key, "-d", shellQuote(JSON.stringify(body))];
  return parts.join(" ");
}

function pyLiteral(value, indent = "") {
  if (value === null || value === undefined) return "None";
  if (value === true) return "True";
  if (value === false) return "False";
  if (typeof value === "number" || typeof value === "string") return JSON.stringify(value);
  const inner = `${indent}    `;
  if (Array.isArray(value)) {
    if (!value.length) return "[]";
    return `[\n${value.map((v) => inner + pyLiteral(v, inner)).join(",\n")},\n${indent}]`;
  }
  const entries = Object.entries(value);
  if (!entries.length) return "{}";
  return `{\n${entries.map(([k, v]) => `${inner}${JSON.stringify(k)}: ${pyLiteral(v, inner)}`).join(",\n")},\n${indent}}`;
}

const OPENAI_PARAMS = ["model", "messages", "stream", "stream_options", "temperature", "top_p", "seed",
  "stop", "max_tokens", "tools", "tool_choice", "reasoning_effort"];

function pythonSnippet(body) {
  const args = [];
  const extra = {};
  for (const [key, value] of Object.entries(body)) {
    if (OPENAI_PARAMS.includes(key)) args.push(`    ${key}=${pyLiteral(value, "    ")},`);
    else extra[key] = value;
  }
  if (Object.keys(extra).length) args.push(`    extra_body=${pyLiteral(extra, "    ")},`);
  const key = $("#k-api-key").value.trim() ? 'os.environ["DSASERVE_API_KEY"]' : '"EMPTY"';
  return [
    "import os", "", "from openai import OpenAI", "",
    `client = OpenAI(base_url=${JSON.stringify(`${location.origin}/v1`)}, api_key=${key})`,
    "stream = client.chat.completions.create(", ...args, ")",
    "for chunk in stream:",
    "    delta = chunk.choices[0].delta if chunk.choices else None",
    "    if delta is not None and delta.content:",
    '        print(delta.content, end="", flush=True)',
    "print()",
  ].join("\n");
}

function updateRequestView() {
  let body;
  try {
    body = buildRequest($("#prompt").value);
  } catch (e) {
    $("#request-json").textContent = `tools: ${e.message}`;
    return null;
  }
  $("#request-json").textContent = JSON.stringify(body, null, 2);
  $("#request-curl").textContent = curlCommand(body);
  $("#request-python").textContent = pythonSnippet(body);
  return body;
}

function showChatError(text) {
  const box = $("#chat-error");
  box.hidden = !text;
  box.textContent = text || "";
}

function envelopeText(status, body, retryAfter) {
  const e = (body && body.error) || {};
  const parts = [`HTTP ${status}`];
  if (e.type) parts.push(e.type);
  parts.push(e.message || "request failed");
  if (e.param) parts.push(`param: ${e.param}`);
  if (e.code !== undefined && e.code !== status) parts.push(`code: ${e.code}`);
  if (retryAfter) parts.push(`Retry-After: ${retryAfter} s`);
  return parts.join(" · ");
}

function addUserMessage(text) {
  $("#messages").append(el("div", { className: "msg user" },
    el("div", { className: "who" }, el("span", { className: "role", textContent: "user" })),
    el("div", { className: "content", textContent: text })));
}

function addToolResultMessage(id, text) {
  $("#messages").append(el("div", { className: "msg tool" },
    el("div", { className: "who" }, el("span", { className: "role", textContent: "tool result" }),
      ` · ${id}`),
    el("pre", { className: "content", textContent: text })));
}

function newTurn() {
  const reasoningText = el("pre", { className: "reasoning-text" });
  const reasoning = el("details", { className: "reasoning", hidden: true },
    el("summary", { textContent: "Reasoning" }), reasoningText);
  const node = el("div", { className: "msg assistant", "data-state": "streaming" },
    el("div", { className: "who" }, el("span", { className: "role", textContent: "assistant" })),
    reasoning,
    el("div", { className: "content" }), el("div", { className: "tool-calls" }),
    el("div", { className: "meta" }));
  $("#messages").append(node);
  return { node, reasoning: "", content: "", calls: [], finish: null, usage: null,
    start: performance.now(), first: null, end: null, results: new Map() };
}

function renderTurn(turn) {
  const { node } = turn;
  const details = $(".reasoning", node);
  details.hidden = !turn.reasoning;
  $(".reasoning-text", node).textContent = turn.reasoning;
  $("summary", details).textContent = `Reasoning · ${turn.reasoning.length} chars`;
  $(".content", node).textContent = turn.content;
  turn.calls.forEach((call, index) => {
    if (!call.card) call.card = toolCard(turn, index);
    $(".tool-name", call.card).textContent = call.name;
    $(".tool-id", call.card).textContent = call.id;
    $(".tool-args", call.card).textContent = call.arguments;
  });
  renderMeta(turn);
}

function renderMeta(turn) {
  const items = [];
  if (turn.finish) items.push(["finish_reason", turn.finish]);
  const u = turn.usage;
  if (u) {
    items.push(["prompt", u.prompt_tokens], ["completion", u.completion_tokens]);
    if (u.reasoning_tokens !== undefined) items.push(["reasoning", u.reasoning_tokens]);
    const cached = u.prompt_tokens_details ? u.prompt_tokens_details.cached_tokens : undefined;
    items.push(["cached", cached ?? "–"]);
  }
  if (turn.first !== null) items.push(["TTFT", `${Math.round(turn.first - turn.start)} ms`]);
  if (turn.end !== null && turn.first !== null && u && u.completion_tokens > 1) {
    const seconds = (turn.end - turn.first) / 1000;
    if (seconds >= 0.05) items.push(["tok/s", ((u.completion_tokens - 1) / seconds).toFixed(1)]);
  }
  $(".meta", turn.node).replaceChildren(...items.map(([k, v]) => el("span", { className: "pill",
    "data-key": k }, el("b", { textContent: `${k} ` }), String(v))));
}

function toolCard(turn, index) {
  const result = el("textarea", { className: "tool-result", rows: 2, placeholder: "tool result (JSON or text)" });
  const send = el("button", { type: "button", className: "send-result", textContent: "Send result" });
  const card = el("div", { className: "tool-call", "data-index": String(index) },
    el("div", { className: "tool-head" }, el("span", { className: "tag", textContent: "tool call" }),
      el("span", { className: "tool-name" }), el("code", { className: "tool-id" })),
    el("pre", { className: "tool-args" }),
    el("div", { className: "tool-reply" }, result, send));
  send.addEventListener("click", () => sendToolResult(turn, index, result.value, send));
  $(".tool-calls", turn.node).append(card);
  return card;
}

function sendToolResult(turn, index, text, button) {
  const call = turn.calls[index];
  if (turn.results.has(call.id) || chat.controller) return;
  turn.results.set(call.id, text);
  button.disabled = true;
  chat.history.push({ role: "tool", tool_call_id: call.id, content: text });
  addToolResultMessage(call.id, text);
  if (turn.results.size === turn.calls.length) send(null);
}

function applyChunk(turn, chunk) {
  if (chunk.error) {
    showChatError(envelopeText("stream", chunk, null));
    return;
  }
  if (chunk.usage && (!chunk.choices || !chunk.choices.length)) turn.usage = chunk.usage;
  for (const choice of chunk.choices || []) {
    const delta = choice.delta || {};
    const text = delta.reasoning_content || delta.content || delta.tool_calls;
    if (text && turn.first === null) turn.first = performance.now();
    if (delta.reasoning_content) turn.reasoning += delta.reasoning_content;
    if (delta.content) turn.content += delta.content;
    for (const part of delta.tool_calls || []) {
      if (!turn.calls[part.index]) turn.calls[part.index] = { id: "", name: "", arguments: "" };
      const call = turn.calls[part.index];
      if (part.id) call.id = part.id;
      if (part.function && part.function.name) call.name = part.function.name;
      if (part.function && part.function.arguments) call.arguments += part.function.arguments;
    }
    if (choice.finish_reason) turn.finish = choice.finish_reason;
  }
}

async function readStream(response, turn) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        applyChunk(turn, JSON.parse(data));
      }
      renderTurn(turn);
    }
  }
}

function finishTurn(turn) {
  const message = { role: "assistant", content: turn.content };
  if (turn.reasoning) message.reasoning_content = turn.reasoning;
  if (turn.calls.length) {
    message.tool_calls = turn.calls.map((c) => ({ id: c.id, type: "function",
      function: { name: c.name, arguments: c.arguments } }));
  }
  chat.history.push(message);
  turn.end = performance.now();
  turn.node.dataset.state = turn.finish || "done";
  renderTurn(turn);
}

async function send(prompt) {
  if (chat.controller || !app.config.chat) return;
  let body;
  try {
    body = buildRequest(prompt);
  } catch (e) {
    showChatError(`tools: ${e.message}`);
    return;
  }
  showChatError("");
  if (prompt !== null) {
    chat.history.push({ role: "user", content: prompt });
    addUserMessage(prompt);
    $("#prompt").value = "";
  }
  const turn = newTurn();
  chat.controller = new AbortController();
  setBusy(true);
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", signal: chat.controller.signal, body: JSON.stringify(body),
      headers: { "Content-Type": "application/json", ...authHeaders() },
    });
    if (!response.ok) {
      let envelope = null;
      try { envelope = await response.json(); } catch { envelope = null; }
      showChatError(envelopeText(response.status, envelope, response.headers.get("Retry-After")));
      turn.node.remove();
      return;
    }
    await readStream(response, turn);
    finishTurn(turn);
  } catch (e) {
    if (e.name === "AbortError") {
      turn.finish = turn.finish || "stopped";
      finishTurn(turn);
    } else {
      showChatError(`request failed: ${e.message}`);
      turn.node.remove();
    }
  } finally {
    chat.controller = null;
    setBusy(false);
    updateRequestView();
    refreshStatus();
  }
}

function setBusy(busy) {
  $("#send").disabled = busy || !app.config.chat;
  $("#stop").disabled = !busy;
  document.body.dataset.chat = busy ? "streaming" : "idle";
}

function stop() {
  if (chat.controller) chat.controller.abort();
}

function newChat() {
  stop();
  chat.history = [];
  $("#messages").replaceChildren();
  showChatError("");
  updateRequestView();
}

// ------------------------------------------------------------------ wiring

function wireDeploy() {
  const form = $("#plan-form");
  form.addEventListener("submit", (e) => e.preventDefault());
  form.addEventListener("input", (e) => formChanged(!AXES.includes(e.target.name) && e.target.name !== "base"
    && e.target.name !== "precision"));
  $("#f-base").addEventListener("change", () => {
    const base = $("#f-base").value;
    if (!app.options.models.some((m) => m.base === base && m.precision === $("#f-precision").value)) {
      $("#f-precision").value = app.options.models.find((m) => m.base === base).precision;
    }
  });
  $("#use-nearest").addEventListener("click", useNearest);
  for (const radio of $$("input[name=flavour]")) {
    radio.addEventListener("change", () => {
      app.flavour = radio.value;
      if (app.lastPlan && app.lastPlan.ok) renderCommands(app.lastPlan.commands);
    });
  }
}

function wirePlayground() {
  $("#composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("#prompt").value;
    if (text.trim()) send(text);
  });
  $("#prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("#composer").requestSubmit();
    }
  });
  $("#stop").addEventListener("click", stop);
  $("#new-chat").addEventListener("click", newChat);
  $("#k-tools-sample").addEventListener("click", () => {
    $("#k-tools").value = JSON.stringify(SAMPLE_TOOLS, null, 2);
    updateToolChoices();
    updateRequestView();
  });
  $("#k-tools").addEventListener("change", updateToolChoices);
  $("#knobs").addEventListener("input", updateRequestView);
  $("#prompt").addEventListener("input", updateRequestView);
  $("#k-api-key").addEventListener("change", refreshStatus);
  $("#copy-json").addEventListener("click", (e) => copyText($("#request-json").textContent, e.target));
  $("#copy-curl").addEventListener("click", (e) => copyText($("#request-curl").textContent, e.target));
  $("#copy-python").addEventListener("click", (e) => copyText($("#request-python").textContent, e.target));
}

async function main() {
  for (const button of $$(".tabs [data-tab]")) {
    button.addEventListener("click", () => setTab(button.dataset.tab));
  }
  const [config, options] = await Promise.all([getJSON("/console/config.json"), getJSON("/api/plan/options")]);
  app.config = config.body;
  app.options = options.body;
  app.defaults = options.body.defaults;
  app.rules = Object.fromEntries(options.body.rules.map((r) => [r.name, r.text]));
  $("#version").textContent = app.config.version || "";
  buildForm();
  const { tab, params } = readHash();
  writeForm(requestFromParams(params));
  wireDeploy();
  wirePlayground();
  $("#api-key-row").hidden = !app.config.api_key_required;
  $("#no-chat").hidden = app.config.chat;
  setBusy(false);
  setTab(tab);
  updateRequestView();
  await Promise.all([planNow(), refreshMatrix()]);
  pollStatus();
  document.body.dataset.ready = "true";
}

main();
