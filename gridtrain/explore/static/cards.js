// gridtrain explore: the calculations page, generated from GET /api/cards (gridtrain/plan/lessons.py).
"use strict";

// ---- the calculations page ----

function stateQuery(s) {
  const params = new URLSearchParams();
  for (const k of BASE_KEYS) if (s[k] !== undefined) params.set(k, s[k]);
  for (const [k, v] of Object.entries(s.shape || {})) params.set(k, v);
  for (const [k, v] of Object.entries(s.layout || {})) params.set(k, v);
  return `?${params}#explore`;
}

function showAnswers(box, answers) {
  const table = clear(box.querySelector("table"));
  for (const a of answers) {
    const tr = el("tr", { "data-answer": a.label });
    tr.append(el("th", {}, a.label), el("td", { class: "value", "data-value": a.value }, fmt(a.value, 4)), el("td", {}, a.unit));
    table.append(tr);
  }
}

async function loadCards() {
  const box = $("cards");
  if (box.dataset.loaded) return;
  const [status, cards] = await call("GET", "/api/cards");
  if (status !== 200) { box.textContent = cards.error; return; }
  box.dataset.loaded = "1";
  drawCardIndex(cards);
  for (const c of cards) {
    const card = el("div", { class: "card", id: `card-${c.id}` });
    card.append(el("h3", {}, c.title), el("p", { class: "hint" }, `${c.topic}; ${c.source}`),
                el("p", { class: "formula" }, c.formula));
    const inputs = el("div", { class: "inputs" });
    for (const i of c.inputs) {
      const label = el("label", {}, `${i.label}${i.unit ? ` (${i.unit})` : ""}`);
      label.append(el("input", { type: "number", step: "any", name: i.name, value: i.default, "data-input": i.name }));
      inputs.append(label);
    }
    card.append(inputs, el("table", { class: "numbers answers" }), el("p", { class: "error" }));
    const notes = el("div", { class: "notes" });
    const worked = c.inputs.map((i) => `${i.name} = ${fmt(i.default)}${i.unit ? ` ${i.unit}` : ""}`).join(", ");
    notes.append(el("p", { class: "hint notes-for" }, ""));
    if (c.quoted) notes.append(el("p", { class: "hint quoted" }, `Usually quoted: ${c.quoted}`));
    if (c.correction) notes.append(el("p", { class: "correction" }, `Corrected: ${c.correction}`));
    if (c.quoted || c.correction) card.append(notes);
    if (c.explore && Object.keys(c.explore).length) card.append(el("a", { href: stateQuery(c.explore), class: "to-explorer" }, "open in the explorer"));
    showAnswers(card, c.answers);
    if (c.id === "roofline") {
      card.append(el("svg", { class: "chart roofline", width: 720, height: 260 }));
      drawRoofline(card, c.answers, c.machine);
    }
    let latest = 0;
    inputs.addEventListener("input", async () => {
      const mine = ++latest;
      // The quoted and corrected notes are about the worked problem: say so once the inputs leave it.
      const edited = [...inputs.querySelectorAll("input")].some((i) => Number(i.value) !== Number(i.defaultValue));
      notes.classList.toggle("edited", edited);
      notes.querySelector(".notes-for").textContent = edited
        ? `These notes are about the worked problem (${worked}), not the inputs above; the answers above are.` : "";
      const body = {};
      const blank = [...inputs.querySelectorAll("input")].filter((input) => input.value === "").map((i) => i.name);
      for (const input of inputs.querySelectorAll("input")) if (input.value !== "") body[input.name] = Number(input.value);
      const error = card.querySelector(".error");
      if (blank.length) {
        error.textContent = `give a number for ${blank.join(", ")}`;
        clear(card.querySelector("table"));
        return;
      }
      const [st, data] = await call("POST", `/api/cards/${c.id}`, body);
      if (mine !== latest) return;  // an answer to an older edit
      error.textContent = st === 200 ? "" : data.error;
      if (st === 200) showAnswers(card, data.answers);
      else clear(card.querySelector("table"));
      if (st === 200 && c.id === "roofline") drawRoofline(card, data.answers, c.machine);
    });
    box.append(card);
  }
  $("cards-convention").addEventListener("change", applyCardConvention);
}

// The roofline on log-log axes: the accelerator's roof (up at slope 1 to the ridge, then flat at the
// peak), decode and the training matmul on it, and this machine's roof as gridtrain calibrate measured it.
function drawRoofline(card, answers, machine) {
  const a = Object.fromEntries(answers.map((x) => [x.label, x.value]));
  const svg = clear(card.querySelector("svg.roofline"));
  const peak = Number(card.querySelector("input[name='peak_tflops']").value);
  const left = 60, right = 700, top = 10, bottom = 220;
  const [x0, x1, y0, y1] = [-2, 5, -4, 4];  // decades of FLOP/byte and of TFLOP/s
  const px = (v) => left + (Math.log10(v) - x0) / (x1 - x0) * (right - left);
  const py = (v) => bottom - (Math.log10(v) - y0) / (y1 - y0) * (bottom - top);
  for (let e = x0; e <= x1; e++) svg.append(el("text", { x: px(10 ** e) - 8, y: bottom + 14 }, `1e${e}`));
  for (let e = y0; e <= y1; e += 2) svg.append(el("text", { x: 4, y: py(10 ** e) + 4 }, `1e${e}`));
  svg.append(el("text", { x: left, y: bottom + 30 }, "FLOP per byte of memory traffic (log)"));
  svg.append(el("text", { x: left + 4, y: top + 10 }, "TFLOP/s (log)"));
  const roof = (ridge, top, color, name) => {
    const start = 10 ** x0;
    svg.append(el("polyline", { points: `${px(start)},${py(top * start / ridge)} ${px(ridge)},${py(top)} ${px(10 ** x1)},${py(top)}`,
                                fill: "none", stroke: color, "stroke-width": 2, "data-roof": name }));
    svg.append(el("text", { x: px(ridge) + 4, y: py(top) - 4, style: `fill: ${color}` },
                  `${name}: ridge ${fmt(ridge, 3)} FLOP/byte`));
  };
  if (peak > 0) roof(a["ridge point"], peak, "#1f4e89", "accelerator");
  if (machine) {
    const p = machine.peak_tflops[machine.precision];
    roof(machine.ridge, p, "#b07aa1", `this machine (${machine.precision}, ${machine.threads} thread(s), measured)`);
  }
  for (const [label, x, y, color] of [["decode", a["decode intensity"], a["decode reaches"], "#e15759"],
                                      ["training matmul", a["training matmul intensity"], a["training matmul reaches"], "#59a14f"]]) {
    svg.append(el("circle", { cx: px(x), cy: py(y), r: 5, fill: color, "data-point": label }));
    svg.append(el("text", { x: px(x) + 7, y: py(y) + 14, style: `fill: ${color}` }, label));
  }
}

// An index of the cards by topic; a click scrolls to the card (the hash keeps the view).
function drawCardIndex(cards) {
  const index = clear($("card-index"));
  const topics = new Map();
  for (const c of cards) topics.set(c.topic, [...(topics.get(c.topic) || []), c]);
  for (const [topic, list] of topics) {
    const item = el("li", {}, `${topic}: `);
    list.forEach((c, i) => {
      const link = el("a", { href: "#cards", "data-card": c.id }, c.title);
      link.addEventListener("click", (event) => { event.preventDefault(); $(`card-${c.id}`).scrollIntoView(); });
      item.append(...(i ? [", ", link] : [link]));
    });
    index.append(item);
  }
}

// The bytes-per-parameter switch: cards that take w, g and K (weights, gradients, optimizer state)
// get the convention's, or their source's defaults back.
function applyCardConvention() {
  const c = OPTIONS.conventions[$("cards-convention").value];
  for (const card of document.querySelectorAll(".card")) {
    const inputs = ["w", "g", "K"].map((n) => card.querySelector(`input[name='${n}']`));
    if (inputs.some((i) => !i)) continue;
    const values = c ? [c.weights, c.gradients, c.optimizer] : inputs.map((i) => i.defaultValue);
    inputs.forEach((input, j) => { input.value = values[j]; });
    inputs[0].dispatchEvent(new Event("input", { bubbles: true }));
  }
}
