// gridtrain explore: the page. Every number comes from the server (the planner); this file only
// keeps the state (in the URL), sends it, and hands the answers to charts.js to draw.
"use strict";

const BASE_KEYS = ["model", "gpu", "cluster", "num_gpus", "seq_len", "global_batch", "tokens", "precision", "implementation",
                   "convention", "hbm_usable", "doc_len"];
const LAYOUT_KEYS = ["tp", "pp", "cp", "zero", "rep", "mb", "schedule", "v", "recompute", "ep"];
const SHAPE_KEYS = ["dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size"];
const DEFAULTS = { model: "llama3-8b", gpu: "h100", num_gpus: "8", seq_len: "4096", global_batch: "512",
                   tokens: "", precision: "bf16", implementation: "eager", convention: "gridtrain" };
const CHOICES = { tp: [1, 2, 4, 8, 16], pp: [1, 2, 4, 8, 16, 32], cp: [1, 2, 4, 8, 16], zero: [0, 1, 2, 3],
                  rep: [1, 2, 4, 8, 16, 32], mb: [1, 2, 4, 8, 16], v: [1, 2, 3, 4, 8] };

let OPTIONS = null;
let state = {};
let sequence = 0;
let timer = null;
const planRequest = latest();
const rankRequest = latest();
const DEBOUNCE_MS = 300;  // typing "8192" sends one request, not four

function layoutLabel(l) {
  const parts = [`tp ${l.tp}`, `pp ${l.pp}`, `cp ${l.cp}`, `dp ${l.dp_replicate * l.dp_shard}`];
  if (l.zero_stage >= 2 && l.dp_replicate * l.dp_shard > 1) parts[3] += ` (${l.dp_replicate} replicas x ${l.dp_shard} shards)`;
  parts.push(`ZeRO ${l.zero_stage}`, `mb ${l.micro_batch} x ${l.num_microbatches}`);
  if (l.pp > 1) parts.push(l.pp_schedule + (l.pp_virtual_stages > 1 ? ` v${l.pp_virtual_stages}` : ""));
  if (l.ep > 1) parts.push(`ep ${l.ep}`);
  if (l.sequence_parallel) parts.push("SP");
  if (l.recompute !== "none") parts.push(`recompute ${l.recompute}`);
  return parts.join(", ");
}

// ---- state: URL <-> form ----

function readURL() {
  const params = new URLSearchParams(location.search);
  state = { ...DEFAULTS };
  for (const k of [...BASE_KEYS, ...LAYOUT_KEYS, ...SHAPE_KEYS]) if (params.has(k)) state[k] = params.get(k);
}

function writeURL() {
  const params = new URLSearchParams();
  for (const k of [...BASE_KEYS, ...LAYOUT_KEYS, ...SHAPE_KEYS]) {
    if (state[k] !== undefined && state[k] !== "") params.set(k, state[k]);
  }
  history.replaceState(null, "", `?${params}${location.hash}`);
}

function setSelect(select, value) {
  const v = value === undefined ? "" : String(value);
  if (![...select.options].some((o) => o.value === v)) select.append(el("option", { value: v }, v));
  select.value = v;
}

function presetShape() { return OPTIONS.models[state.model] || {}; }

function fillForm() {
  const form = $("inputs");
  for (const k of [...BASE_KEYS, ...LAYOUT_KEYS]) {
    const input = form.elements[k];
    if (input.tagName === "SELECT") setSelect(input, state[k] ?? "");
    else input.value = state[k] ?? "";
  }
  const shape = presetShape();
  for (const k of SHAPE_KEYS) form.elements[k].value = state[k] ?? shape[k] ?? "";
  $("shape-box").open = SHAPE_KEYS.some((k) => state[k] !== undefined);
  conventionNote();
  expertChoices(shape.experts || 0);
  const active = shape.experts ? `, ${fmt(shape.active_params / 1e9, 3)}B active (${shape.experts} experts)` : "";
  $("model-params").textContent = shape.params ? `preset: ${fmt(shape.params / 1e9, 3)}B parameters${active}, context ${shape.max_seq_len}` : "";
}

function expertChoices(experts) {
  // Expert parallelism splits a mixture of experts' routed experts: ep divides their number.
  const select = $("in-ep");
  clear(select);
  select.append(el("option", { value: "" }, experts ? "auto" : "1 (dense)"));
  for (let ep = 2; ep <= experts; ep++) if (experts % ep === 0) select.append(el("option", { value: String(ep) }, String(ep)));
  if (!experts && state.ep) delete state.ep;
  select.disabled = !experts;
  select.title = experts ? "expert parallelism: ep of the dp x cp ranks (ep divides dp x cp), each holding E / ep experts of every MoE layer"
                         : "expert parallelism needs a mixture-of-experts model";
  select.value = state.ep ?? "";
}

function onInput(event) {
  const k = event.target.name;
  if (!k) return;
  if (SHAPE_KEYS.includes(k)) {
    const preset = presetShape()[k];
    if (event.target.value === "" || Number(event.target.value) === preset) delete state[k];
    else state[k] = event.target.value;
  } else {
    state[k] = event.target.value;
  }
  if (k === "model") { for (const s of SHAPE_KEYS) delete state[s]; fillForm(); }
  if (k === "convention") conventionNote();
  clear($("best"));  // ranked for other inputs
  $("why-first").textContent = "";
  rankRequest.abort();
  $("search-note").textContent = "";
  writeURL();
  schedule();
}

function schedule() {
  document.body.dataset.pending = "1";
  $("outputs").classList.add("stale");
  clearTimeout(timer);
  timer = setTimeout(update, DEBOUNCE_MS);
}

// ---- the request ----

function number(v) { return v === undefined || v === "" ? undefined : Number(v); }

function requestBody(withLayout = true) {
  const body = { model: state.model, gpu: state.gpu, precision: state.precision, implementation: state.implementation,
                 convention: state.convention };
  if (state.cluster) body.cluster = state.cluster;
  for (const k of ["num_gpus", "seq_len", "global_batch", "tokens", "hbm_usable", "doc_len"]) {
    if (number(state[k]) !== undefined) body[k] = number(state[k]);
  }
  const shape = {};
  for (const k of SHAPE_KEYS) if (number(state[k]) !== undefined) shape[k] = number(state[k]);
  if (Object.keys(shape).length) body.shape = shape;
  if (!withLayout) { body.top = 10; return body; }
  const layout = {};
  for (const k of ["tp", "pp", "cp", "zero", "mb", "v", "ep"]) if (number(state[k]) !== undefined) layout[k] = number(state[k]);
  for (const k of ["schedule", "recompute"]) if (state[k]) layout[k] = state[k];
  const note = [];
  const fixed = ["tp", "pp", "cp"].every((k) => layout[k] !== undefined);
  const repInput = $("in-rep");
  repInput.disabled = !(fixed && (layout.zero === 2 || layout.zero === 3));
  repInput.title = repInput.disabled ? "HSDP replicas apply once tp, pp, cp are fixed and ZeRO is 2 or 3" : "";
  repInput.classList.remove("invalid");
  $("in-gpu").disabled = Boolean(state.cluster);
  $("in-gpu").title = state.cluster ? `the cluster's accelerator: ${OPTIONS.cluster_accelerators[state.cluster]}` : "";
  if (fixed && body.num_gpus) {
    const dp = body.num_gpus / (layout.tp * layout.pp * layout.cp);
    const rep = number(state.rep) || 1;
    if (Number.isInteger(dp)) {
      if ((layout.zero === 2 || layout.zero === 3)) {
        if (Number.isInteger(dp / rep)) layout.dp_shard = dp / rep;
        else repInput.classList.add("invalid");
        note.push(`dp = ${body.num_gpus} / (tp ${layout.tp} x pp ${layout.pp} x cp ${layout.cp}) = ${dp}` +
                  (Number.isInteger(dp / rep) ? ` = ${rep} replica(s) x ${dp / rep} shards`
                                              : `: ${rep} replicas do not divide it`));
      } else {
        note.push(`dp = ${body.num_gpus} / (tp ${layout.tp} x pp ${layout.pp} x cp ${layout.cp}) = ${dp}` +
                  (layout.zero === undefined ? "" : `, all replicas (ZeRO ${layout.zero})`));
      }
    }
  } else {
    note.push("dp follows once tp, pp and cp are fixed; replicas apply with ZeRO 2 or 3");
  }
  $("dp-line").textContent = note.join("");
  body.layout = layout;
  return body;
}

async function update() {
  // data-pending is 1 from an input's change until its answer is drawn (tests wait on it).
  document.body.dataset.pending = "1";
  clearTimeout(timer);
  const mine = ++sequence;
  const body = requestBody();
  const [status, data] = await call("POST", "/api/plan", body, planRequest.next());
  if (mine !== sequence || data.aborted) return;
  renderPlan(status, data);
  $("verdict").dataset.request = JSON.stringify(body);  // what this verdict answers (tests read it)
  $("outputs").classList.remove("stale");
  document.body.dataset.pending = "0";
}

// ---- drawing the plan ----

function partialNote(data) {
  return data.partial ? " (partial: the best of the layouts the search costed in its time; fix more of the " +
    "layout, or run the command, for the best of all)" : "";
}

function renderPlan(status, data) {
  const verdict = $("verdict");
  const reason = $("reason");
  $("command").textContent = data.command || "";
  $("elapsed").textContent = data.elapsed_ms !== undefined ? `(answered in ${fmt(data.elapsed_ms, 3)} ms)` : "";
  if (status !== 200) {
    // Only 400 and 422 say the inputs are wrong; a timeout (503) or a lost server says nothing of them.
    const refused = status === 400 || status === 422;
    verdict.className = refused ? "verdict invalid" : "verdict unknown";
    verdict.textContent = refused ? "invalid: the planner cannot take these inputs"
      : status === 503 ? "not known yet: the search found no layout in its time" : "no answer from the server";
    reason.hidden = false;
    reason.textContent = data.error || `HTTP ${status}`;
    for (const id of ["memory", "steptime", "timeline"]) clear($(id)).setAttribute("height", 20);
    for (const id of ["metrics", "bytes"]) clear($(id));
    $("timeline-note").textContent = "";
    drawFixes([]);
    return;
  }
  const plan = data.plan;
  const cand = plan.fits ? plan.chosen : plan.leanest;
  const mem = plan.memory;
  reason.hidden = plan.fits;
  reason.textContent = plan.fits ? "" : plan.reason;
  if (plan.fits) {
    verdict.className = "verdict fits";
    verdict.textContent = `fits: ${fmt(mem.total_GiB, 3)} GiB at the peak (pipeline rank ${mem.rank}) of ` +
      `${fmt(mem.limit_GiB, 3)} GiB usable; ${layoutLabel(cand.layout)}` + partialNote(data);
  } else {
    verdict.className = "verdict nofit";
    const fix = (plan.fixes || [])[0];
    verdict.textContent = (cand ? `does not fit: the leanest layout needs ${fmt(mem.total_GiB, 3)} GiB of ` +
      `${fmt(mem.limit_GiB, 3)} GiB usable` : "does not fit: no layout can run these inputs") +
      (fix ? `; best fix: ${fix.change}` : "") + partialNote(data);
  }
  drawFixes(plan.fits ? [] : plan.fixes || []);
  const custom = Object.keys(requestBody(false).shape || {}).length > 0;
  const shape = presetShape();  // a preset's active parameters and experts (a custom shape's are not known here)
  const active = shape.experts && !custom ? `, ${fmt(shape.active_params / 1e9, 3)}B active (${shape.experts} experts)` : "";
  $("model-params").textContent = `${fmt(plan.problem.params / 1e9, 4)}B parameters${active} (${plan.problem.model}` +
    `${custom ? ", custom shape" : ""})`;
  drawMemory(mem);
  drawStateLine(plan);
  // A layout that does not fit has no step time and no MFU: it cannot run.
  drawStepTime(plan.fits ? cand : null);
  drawMetrics(plan, plan.fits ? cand : null);
  drawBytes(plan.bytes_per_axis);
  drawTimeline(data.timeline);
}

function conventionNote() {
  const c = OPTIONS.conventions[state.convention];
  $("convention-note").textContent = c ? `${c.total} bytes: weights ${c.weights}, gradients ${c.gradients}, ` +
    `optimizer ${c.optimizer}; ${c.counts}` : "";
}

function applyFix(f) {
  for (const [k, v] of Object.entries(f.set || {})) state[k] = String(v);
  applyLayout(f.layout);
}

// ---- best layouts ----

async function rankLayouts() {
  $("search-note").textContent = "searching...";
  const [status, data] = await call("POST", "/api/plan", requestBody(false), rankRequest.next());
  if (data.aborted) return;
  const table = clear($("best"));
  if (status !== 200 || !data.plan.fits) {
    $("search-note").textContent = status === 200 ? data.plan.reason : data.error;
    return;
  }
  const s = data.plan.search;
  $("search-note").textContent = `${s.evaluated.toLocaleString()} of ${s.enumerated.toLocaleString()} layouts costed ` +
    `(${data.command}); click a row to apply it` + partialNote(data);
  $("why-first").textContent = (data.plan.why_first || []).join(" ");
  const head = el("tr");
  for (const h of ["#", "layout", "MFU", "tokens/s", "step", "peak GiB", "differs from #1 in", "same time with", ""]) {
    head.append(el("th", {}, h));
  }
  table.appendChild(el("thead")).append(head);
  const body = table.appendChild(el("tbody"));
  const first = data.plan.ranked[0].layout;
  data.plan.ranked.forEach((c, i) => {
    const tr = el("tr", { class: c.refused ? "refused" : "" });
    const same = c.varies ? `${CHOICE_NAMES[c.varies] || c.varies} ${c.values.join(", ")}` : "";
    tr.append(el("td", {}, `${i + 1}`), el("th", {}, layoutLabel(c.layout)), el("td", {}, `${fmt(c.mfu * 100, 3)}%`),
              el("td", {}, fmt(c.tokens_per_s)), el("td", {}, `${fmt(c.step_s, 3)} s`), el("td", {}, fmt(c.peak_GiB, 3)),
              el("td", { class: "differs" }, i ? differences(first, c.layout) : ""), el("td", {}, same),
              el("td", {}, c.refused ? `refused: ${c.refused}` : ""));
    tr.addEventListener("click", () => applyLayout(c.layout));
    body.append(tr);
  });
}

const CHOICE_NAMES = { tp: "tp", pp: "pp", cp: "cp", dp: "dp", dp_shard: "shards", zero_stage: "ZeRO", micro_batch: "mb",
                       recompute: "recompute", pp_schedule: "schedule", pp_virtual_stages: "v", ep: "ep" };

// What a ranked layout changes against the first: "v 4 -> 6, ZeRO 3 -> 2".
function differences(a, b) {
  return Object.entries(CHOICE_NAMES).filter(([k]) => a[k] !== b[k]).map(([k, name]) => `${name} ${a[k]} -> ${b[k]}`)
    .join(", ") || "nothing the table shows";
}

function applyLayout(l) {
  Object.assign(state, { tp: l.tp, pp: l.pp, cp: l.cp, zero: l.zero_stage, mb: l.micro_batch,
                         schedule: l.pp_schedule, v: l.pp_virtual_stages, recompute: l.recompute,
                         rep: l.zero_stage >= 2 ? l.dp_replicate : "", ep: (l.ep || 1) > 1 ? l.ep : "" });
  for (const k of LAYOUT_KEYS) state[k] = String(state[k]);
  fillForm();
  writeURL();
  update();
}

function applyState(s) {
  state = { ...DEFAULTS };
  for (const k of BASE_KEYS) if (s[k] !== undefined) state[k] = String(s[k]);
  for (const [k, v] of Object.entries(s.shape || {})) state[k] = String(v);
  for (const [k, v] of Object.entries(s.layout || {})) state[k === "dp_replicate" ? "rep" : k] = String(v);
  fillForm();
  writeURL();
  update();
}

// ---- views ----

function route() {
  let hash = location.hash || "#explore";
  if (!/^#(explore|cards|runs|run\/.*)$/.test(hash)) hash = "#explore";
  const view = hash.startsWith("#run") ? "runs" : hash.slice(1);
  for (const v of ["explore", "cards", "runs"]) {
    $(`view-${v}`).hidden = v !== view;
    $(`nav-${v}`).classList.toggle("active", v === view);
  }
  if (view === "cards") loadCards();
  if (hash === "#runs") { $("run").hidden = true; loadRuns(); }
  if (hash.startsWith("#run/")) {
    let name = null;
    try { name = decodeURIComponent(hash.slice(5)); } catch (e) { name = null; }
    if (name === null) { $("run").hidden = false; clearRun(); $("run-title").textContent = "not a run name: " + hash.slice(5); }
    else loadRun(name);
  }
}

function fillChoices() {
  const auto = (select, values) => {
    select.append(el("option", { value: "" }, "auto"));
    for (const v of values) select.append(el("option", { value: String(v) }, String(v)));
  };
  for (const name of Object.keys(OPTIONS.models)) $("in-model").append(el("option", { value: name }, name));
  for (const gpu of OPTIONS.gpus) $("in-gpu").append(el("option", { value: gpu }, gpu));
  for (const name of OPTIONS.clusters) $("in-cluster").append(el("option", { value: name }, name));
  for (const [k, values] of Object.entries(CHOICES)) auto($(`in-${k}`), values);
  auto($("in-schedule"), OPTIONS.schedules);
  for (const [name, c] of Object.entries(OPTIONS.conventions)) {
    $("in-convention").append(el("option", { value: name, title: c.counts }, c.label));
    $("cards-convention").append(el("option", { value: name, title: c.counts }, c.label));
  }
  auto($("in-recompute"), OPTIONS.recompute);
  for (const p of OPTIONS.presets) {
    const button = el("button", { type: "button", "data-preset": p.name, title: p.text }, p.title);
    button.addEventListener("click", () => applyState(p.state));
    $("presets").append(button);
  }
}

async function main() {
  const [status, options] = await call("GET", "/api/options");
  if (status !== 200) { document.body.textContent = options.error; return; }
  OPTIONS = options;
  fillChoices();
  readURL();
  fillForm();
  $("inputs").addEventListener("input", onInput);
  $("inputs").addEventListener("change", onInput);
  $("search").addEventListener("click", rankLayouts);
  window.addEventListener("hashchange", route);
  route();
  await update();
  document.body.dataset.ready = "1";
}

main();
