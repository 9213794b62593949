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
    });
    box.append(card);
  }
  $("cards-convention").addEventListener("change", applyCardConvention);
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
