// gridtrain explore: the runs view (GET /api/runs, /api/runs/NAME): curves and plan --check, drawn.
"use strict";

// ---- runs ----

function lineChart(svg, series, height) {
  clear(svg);
  svg.setAttribute("height", height);
  const points = series.flatMap((s) => s.xs.map((x, i) => [x, s.ys[i]]).filter(([, y]) => y !== null));
  if (!points.length) { svg.append(el("text", { x: 10, y: 20 }, "no points")); return; }
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  const left = 60, right = 700, top = 10, bottom = height - 30;
  const px = (x) => left + (x1 > x0 ? (x - x0) / (x1 - x0) : 0.5) * (right - left);
  const py = (y) => bottom - (y1 > y0 ? (y - y0) / (y1 - y0) : 0.5) * (bottom - top);
  svg.append(el("line", { x1: left, x2: right, y1: bottom, y2: bottom, stroke: "#999" }));
  svg.append(el("text", { x: 4, y: top + 10 }, fmt(y1, 3)), el("text", { x: 4, y: bottom }, fmt(y0, 3)));
  svg.append(el("text", { x: left, y: height - 12 }, `step ${x0}`), el("text", { x: right - 60, y: height - 12 }, `step ${x1}`));
  series.forEach((s, n) => {
    const pts = s.xs.map((x, i) => [x, s.ys[i]]).filter(([, y]) => y !== null).map(([x, y]) => `${px(x)},${py(y)}`);
    svg.append(el("polyline", { points: pts.join(" "), fill: "none", stroke: s.color, "stroke-width": 1.5, "data-series": s.name }));
    svg.append(el("text", { x: right - 160, y: top + 12 + 14 * n, style: `fill: ${s.color}` }, s.name));
  });
}

async function loadRuns() {
  const box = clear($("runs"));
  const [status, data] = await call("GET", "/api/runs");
  if (status !== 200) { box.textContent = data.error; return; }
  if (!data.root) { box.append(el("p", {}, data.note)); return; }
  box.append(el("h2", {}, `Runs in ${data.root}`));
  const table = el("table", { class: "numbers" });
  const head = el("tr");
  for (const h of ["run", "model", "world", "dp_replicate x dp_shard x cp x tp x pp", "steps", "loss", "val loss"]) head.append(el("th", {}, h));
  table.append(head);
  for (const r of data.runs) {
    const tr = el("tr");
    const link = el("a", { href: `#run/${encodeURIComponent(r.name)}` }, r.name);
    const l = r.layout;
    tr.append(el("th"), el("td", {}, r.model || "?"), el("td", {}, l ? `${l.world}` : "?"),
              el("td", {}, l ? `${l.dp_replicate} x ${l.dp_shard} x ${l.cp} x ${l.tp} x ${l.pp}` : "?"),
              el("td", {}, `${r.steps}`), el("td", {}, fmt(r.loss)), el("td", {}, fmt(r.val_loss)));
    tr.firstChild.append(link);
    table.append(tr);
  }
  box.append(table);
}

function clearRun() {
  for (const id of ["run-loss", "run-tps", "run-load", "run-check", "check"]) clear($(id));
  $("run-load-box").hidden = true;
  for (const id of ["run-layout", "check-note"]) $(id).textContent = "";
}

async function loadRun(name) {
  $("run").hidden = false;
  clear($("runs"));
  clearRun();
  const [status, run] = await call("GET", `/api/runs/${encodeURIComponent(name)}`);
  $("run-title").textContent = status === 200 ? `Run ${run.name}` : run.error;
  if (status !== 200) return;
  const l = run.layout;
  $("run-layout").textContent = `${run.model}, ${run.precision}, ${run.world} ranks on ${run.backend}: dp_replicate ` +
    `${l.dp_replicate} x dp_shard ${l.dp_shard} x cp ${l.cp} x tp ${l.tp} x pp ${l.pp}` + (l.ep > 1 ? `, ep ${l.ep}. ` : ". ");
  if (run.explore) {
    $("run-layout").append(el("a", { href: stateQuery(run.explore), class: "to-explorer" },
                              "the plan of this layout in the explorer"));
  }
  const c = run.curves;
  lineChart($("run-loss"), [{ name: "train loss", xs: c.step, ys: c.loss, color: "#4e79a7" },
                            { name: "validation loss", xs: c.val_step, ys: c.val_loss, color: "#e15759" }], 220);
  lineChart($("run-tps"), [{ name: "tokens/s", xs: c.step, ys: c.tokens_per_s, color: "#59a14f" }], 180);
  const layers = Object.entries(c.expert_load || {});
  $("run-load-box").hidden = !layers.length;
  const colors = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7"];
  if (layers.length) {
    lineChart($("run-load"), layers.map(([name, ys], i) => ({ name: `${name} load`, xs: c.step, ys, color: colors[i % colors.length] })), 200);
  }
  drawCheck(run);
}

// Bytes exactly, and in the binary unit that reads best.
function byteText(x) {
  if (x === null || x === undefined) return "–";
  const units = [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
  const [unit, size] = units.find(([, s]) => Math.abs(x) >= s) || ["", 1];
  return `${fmt(x)} bytes` + (unit ? ` (${fmt(x / size, 4)} ${unit})` : "");
}

// What a row of plan --check compares: a memory bucket (bytes held at the step's peak) or the
// bytes one rank sent on a mesh axis over the accounted steps (key "axis/collective").
function counts(key) {
  const buckets = { weights: "parameters held, tensor by tensor (census.py)",
                    gradients: "gradients held, tensor by tensor (census.py)",
                    optimizer: "Adam's moments and step counts (census.py)",
                    activations: "saved for backward at the peak (activations.py)",
                    buffers: "communication buffers (memory.py's convention)" };
  if (buckets[key]) return `bytes: ${buckets[key]}`;
  const [axis, op] = key.split("/");
  return op ? `payload bytes of the ${op.replace(/_bytes$/, "").replaceAll("_", "-")}s on the '${axis}' mesh axis ` +
    "in one accounted step (run_collectives.py: exact where it models the layout, else marked an estimate)" : "";
}

function drawCheck(run) {
  const table = clear($("check"));
  const svg = clear($("run-check"));
  $("check-note").textContent = run.check_note || "";
  const rows = run.check;
  svg.setAttribute("height", rows.length ? rows.length * 18 + 24 : 20);
  if (!rows.length) return;
  const head = el("tr");
  for (const h of ["rank", "bucket or collective", "predicted", "measured", "measured / predicted", "what it counts"]) {
    head.append(el("th", {}, h));
  }
  table.append(head);
  rows.forEach((r, i) => {
    const ratio = r.predicted ? r.measured / r.predicted : NaN;
    const tr = el("tr", { "data-rank": r.rank, "data-key": r.key });
    const note = r.estimated ? " (estimate)" : r.routed && r.rank !== "all" ? " (expected under uniform routing)" : "";
    tr.append(el("td", {}, `${r.rank}`), el("th", {}, r.key + note),
              el("td", {}, r.missing ? "missing: not predicted" : byteText(r.predicted)), el("td", {}, byteText(r.measured)),
              el("td", {}, fmt(ratio, 5)), el("td", { class: "source" }, counts(r.key)));
    table.append(tr);
    const predicted = r.missing ? 0 : r.predicted;
    const y = 4 + i * 18, left = 230, width = 440, top = Math.max(predicted, r.measured) || 1;
    svg.append(el("text", { x: 4, y: y + 11 }, `rank ${r.rank} ${r.key}` + (r.missing ? " (not predicted)" : "")));
    svg.append(el("rect", { x: left, y, width: (predicted / top) * width, height: 7, fill: "#9fbfe0", "data-predicted": predicted }));
    svg.append(el("rect", { x: left, y: y + 7, width: (r.measured / top) * width, height: 7, fill: "#1f4e89", "data-measured": r.measured }));
  });
  svg.append(el("text", { x: 230, y: rows.length * 18 + 18 }, "light: predicted, dark: measured (each pair to its own scale)"));
}
