// gridtrain explore: the plan's charts and tables (loaded before app.js): memory bars, the model
// state line, the fixes, the step time, the metrics with their sources, bytes per axis, the timeline.
"use strict";

const BUCKETS = ["weights", "gradients", "optimizer", "activations", "buffers"];
const COLORS = {  // memory buckets
  weights: "#4e79a7", gradients: "#f28e2b", optimizer: "#e15759", activations: "#76b7b2", buffers: "#59a14f",
};
const PART_COLORS = {  // parts of the step
  compute: "#4e79a7", tp: "#f28e2b", cp: "#edc948", ep: "#ff9da7", pp: "#b07aa1", bubble: "#bab0ac", dp: "#e15759",
  optimizer: "#59a14f",
};
const PART_LABELS = {
  compute: "compute", tp: "TP communication", cp: "CP communication", ep: "EP all-to-alls", pp: "pipeline sends",
  bubble: "pipeline bubble", dp: "exposed DP/FSDP", optimizer: "optimizer step",
};

function drawStateLine(plan) {
  // The model state of the peak rank in GB (1e9 bytes, as the notes count), beside the bars' GiB.
  const mem = plan.memory;
  if (!mem) { $("state-line").textContent = ""; return; }
  const GB = (gib) => gib * 2 ** 30 / 1e9;
  const b = mem.buckets_GiB;
  const total = GB(b.weights + b.gradients + b.optimizer);
  const c = OPTIONS.conventions[state.convention];
  $("state-line").dataset.gb = total;
  $("state-line").textContent = `model state on pipeline rank ${mem.rank}: ${fmt(total, 4)} GB = weights ` +
    `${fmt(GB(b.weights), 4)} + gradients ${fmt(GB(b.gradients), 4)} + optimizer ${fmt(GB(b.optimizer), 4)} GB, ` +
    `${fmt(plan.problem.params / 1e9, 4)}B parameters at ${c ? c.label : state.convention}`;
}

function drawFixes(fixes) {
  $("fixes").hidden = !fixes.length;
  const table = clear($("fix-table"));
  if (!fixes.length) return;
  const head = el("tr");
  for (const h of ["#", "change", "layout", "MFU", "step", "peak GiB"]) head.append(el("th", {}, h));
  table.appendChild(el("thead")).append(head);
  const body = table.appendChild(el("tbody"));
  fixes.forEach((f, i) => {
    const behind = f.mfu_behind_best > 0 ? ` (${fmt(f.mfu_behind_best * 100, 2)} points behind the first)` : "";
    const tr = el("tr", { "data-fix": i, title: "apply this fix" });
    tr.append(el("td", {}, `${i + 1}`), el("th", {}, f.change), el("td", {}, layoutLabel(f.layout)),
              el("td", {}, `${fmt(f.mfu * 100, 3)}%${behind}`), el("td", {}, `${fmt(f.step_s, 3)} s`),
              el("td", {}, fmt(f.peak_GiB, 3)));
    tr.addEventListener("click", () => applyFix(f));
    body.append(tr);
  });
}

function drawMemory(mem) {
  const svg = clear($("memory"));
  if (!mem) { svg.setAttribute("height", 20); return; }
  const ranks = mem.pipeline_ranks;
  const left = 150, width = 720 - left - 20, row = 26;
  const top = Math.max(mem.hbm_GiB, ...ranks.map((r) => r.total_GiB)) * 1.05;
  const x = (gib) => left + (gib / top) * width;
  const height = 24 + ranks.length * row + 40;
  svg.setAttribute("height", height);
  const last = ranks.length - 1;
  ranks.forEach((r, i) => {
    const y = 18 + i * row;
    const roles = [];
    if (r.rank === 0) roles.push("first");
    if (i === last && ranks.length > 1 && r.rank !== 0) roles.push("last");
    if (r.rank === mem.rank) roles.push("peak");
    svg.append(el("text", { x: 4, y: y + 14 }, `pp rank ${r.rank} (${roles.join(", ")})`));
    let at = 0;
    for (const b of BUCKETS) {
      const gib = r.buckets_GiB[b];
      const rect = el("rect", { x: x(at), y, width: Math.max(0, x(at + gib) - x(at)), height: row - 8,
                               fill: COLORS[b], "data-rank": r.rank, "data-bucket": b, "data-gib": gib });
      rect.append(el("title", {}, `${b}: ${fmt(gib)} GiB`));
      svg.append(rect);
      at += gib;
    }
    svg.append(el("text", { x: x(at) + 4, y: y + 14, "data-total": r.total_GiB }, `${fmt(r.total_GiB, 3)} GiB`));
  });
  const bottom = 18 + ranks.length * row;
  for (const [gib, label, dash] of [[mem.limit_GiB, "usable", "4 3"], [mem.hbm_GiB, "HBM", ""]]) {
    svg.append(el("line", { x1: x(gib), x2: x(gib), y1: 6, y2: bottom, stroke: "#b42318", "stroke-dasharray": dash }));
    svg.append(el("text", { x: x(gib) - 3, y: label === "HBM" ? bottom + 12 : 12, "text-anchor": "end" },
                  `${label} ${fmt(gib, 3)} GiB`));
  }
  BUCKETS.forEach((b, i) => {
    svg.append(el("rect", { x: left + i * 110, y: height - 16, width: 10, height: 10, fill: COLORS[b] }));
    svg.append(el("text", { x: left + i * 110 + 14, y: height - 7 }, b));
  });
}

function drawStepTime(cand) {
  const svg = clear($("steptime"));
  if (!cand) { svg.setAttribute("height", 20); return; }
  const parts = Object.entries(cand.parts_s);
  const total = parts.reduce((s, [, v]) => s + v, 0) || 1;
  const left = 10, width = 700;
  let at = 0;
  svg.setAttribute("height", 60 + 16 * Math.floor((parts.filter(([, v]) => v > 0).length - 1) / 4));
  for (const [name, seconds] of parts) {
    const rect = el("rect", { x: left + (at / total) * width, y: 6, width: (seconds / total) * width, height: 22,
                             fill: PART_COLORS[name] || "#999", "data-part": name, "data-seconds": seconds });
    rect.append(el("title", {}, `${PART_LABELS[name] || name}: ${fmt(seconds * 1e3)} ms`));
    svg.append(rect);
    at += seconds;
  }
  parts.filter(([, v]) => v > 0).forEach(([name, seconds], i) => {
    const x = left + (i % 4) * 175, y = 40 + Math.floor(i / 4) * 16;
    svg.append(el("rect", { x, y, width: 10, height: 10, fill: PART_COLORS[name] || "#999" }));
    svg.append(el("text", { x: x + 14, y: y + 9 }, `${name} ${fmt(seconds * 1e3, 3)} ms`));
  });
}

function drawMetrics(plan, cand) {
  const table = clear($("metrics"));
  const rows = [];  // [name, value, where it comes from]
  const p = plan.problem;
  rows.push(["global batch", `${fmt(p.global_batch_seqs)} sequences = ${fmt(p.global_batch_tokens)} tokens`,
             `${fmt(p.seq_len)} tokens per sequence`]);
  if (cand) {
    rows.push(["step time", `${fmt(cand.step_s * 1e3)} ms`, "the planner's model of this layout"],
              ["MFU", `${fmt(cand.mfu * 100, 3)}%`, "model FLOPs per second against the dense bf16 peak"],
              ["tokens/s", fmt(cand.tokens_per_s), ""],
              ["model FLOPs per token", fmt(cand.model_flops_per_token), "6N + 12 L H Q T (attention counted in full)"],
              ["model FLOPs per step", fmt(cand.model_flops_per_step), "per token x the global batch's tokens"]);
    for (const [name, s] of Object.entries(cand.parts_s)) rows.push([PART_LABELS[name] || name, `${fmt(s * 1e3)} ms`, ""]);
  }
  if (!cand) rows.push(["step time, MFU", "none: the layout does not fit, so it cannot run", ""]);
  const b = plan.budget, a = plan.assumptions;
  if (b) {
    const tokens = state.tokens ? "your token budget"
      : `none given: Chinchilla-optimal, 20 per parameter (Hoffmann et al. 2022); give a token budget to change it`;
    rows.push(["training tokens", fmt(b.tokens), tokens],
              ["days", fmt(b.days), "training tokens / the predicted tokens/s, without failures"],
              ["GPU-hours", fmt(b.gpu_hours), "GPUs x days x 24"],
              ["cost", `$${fmt(b.cost_usd)}`, `at $${fmt(a.price_per_gpu_hour)} per GPU-hour (assumed)`],
              ["energy", `${fmt(b.energy_kwh)} kWh`, `the GPUs' power x PUE ${fmt(a.pue)} (assumed)`],
              ["electricity", `$${fmt(b.electricity_usd)}`, `at $${fmt(a.electricity_per_kwh)} per kWh (assumed)`]);
  }
  for (const [k, v, source] of rows) {
    const tr = el("tr", { "data-metric": k });
    tr.append(el("th", {}, k), el("td", {}, v), el("td", { class: "source" }, source));
    table.append(tr);
  }
}

function drawBytes(bytes) {
  const table = clear($("bytes"));
  const entries = Object.entries(bytes || {});
  if (!entries.length) { table.appendChild(el("tr")).append(el("td", {}, "no collectives")); return; }
  for (const [axis, value] of entries) {
    const tr = el("tr", { "data-axis": axis, "data-bytes": value });
    tr.append(el("th", {}, axis), el("td", {}, `${fmt(value / 2 ** 30)} GiB`));
    table.append(tr);
  }
}

const ACTIONS = {  // kind: [name, hue]
  F: ["forward", 212], B: ["backward", 28], I: ["input-gradient pass", 28], W: ["weight-gradient pass", 130],
};

function drawTimeline(t) {
  const svg = clear($("timeline"));
  $("timeline-note").textContent = t ? t.note : "";
  $("timeline-legend").textContent = "";
  svg.style.display = t && t.ops.length ? "" : "none";
  if (!t || !t.ops.length) return;
  const pp = Math.max(...t.ops.map((o) => o[0])) + 1;
  // The shortest forward at least MIN_FORWARD_PX wide, so 64 micro-batches stay readable: the chart scrolls.
  const MIN_FORWARD_PX = 14;
  const forward = Math.min(...t.ops.filter((o) => o[2] === "F").map((o) => o[4] - o[3]));
  const left = 60, row = 20, width = Math.max(720 - left - 10, (t.makespan / forward) * MIN_FORWARD_PX);
  const scale = width / t.makespan;
  svg.setAttribute("width", left + width + 10);
  svg.setAttribute("height", pp * row + 8);
  if (left + width + 10 > 720) $("timeline-note").textContent = "scroll right for the rest of the step";
  for (let r = 0; r < pp; r++) {
    svg.append(el("text", { x: 4, y: r * row + 15 }, `rank ${r}`));
    svg.append(el("rect", { x: left, y: r * row + 3, width, height: row - 4, fill: "#eee" }));
  }
  for (const [rank, mb, kind, start, end, chunk] of t.ops) {
    if (end <= start) continue;  // the first stage's input-gradient pass: nothing to compute
    const [name, hue] = ACTIONS[kind];
    const light = (kind === "I" ? 70 : 55) + 12 * chunk;
    const rect = el("rect", { x: left + start * scale, y: rank * row + 3, width: Math.max(0.5, (end - start) * scale - 0.5),
                             height: row - 4, fill: `hsl(${hue}, 60%, ${light}%)`, "data-kind": kind });
    rect.append(el("title", {}, `${name} of micro-batch ${mb}` + (chunk ? `, chunk ${chunk}` : "")));
    svg.append(rect);
    if ((end - start) * scale > 12) svg.append(el("text", { x: left + start * scale + 2, y: rank * row + 16 }, `${mb}`));
  }
  const kinds = [...new Set(t.ops.map((o) => o[2]))];
  const legend = { F: "blue: forward", B: "orange: backward", I: "light orange: input-gradient pass",
                   W: "green: weight-gradient pass" };
  $("timeline-legend").textContent = `${kinds.map((k) => legend[k]).join(", ")}, grey: idle (each rank's actions ` +
    `in the runtime's order, replayed at their measured costs, as the planner times them); bubble ` +
    `${fmt(t.bubble * 100, 3)}% of the step`;
}
