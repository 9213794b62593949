// gridtrain explore: the helpers the page's scripts share (loaded first): element and SVG
// builders, number formatting, and the JSON calls to the server.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";

// ---- small helpers ----

// Whole numbers print exactly (16,384, not 16,380); others to `digits` significant digits.
function fmt(x, digits = 4) {
  if (x === null || x === undefined || !isFinite(x)) return "–";
  const a = Math.abs(x);
  if (Number.isInteger(x) && a < 1e15) return x.toLocaleString("en-US");
  if (a !== 0 && (a >= 1e9 || a < 1e-3)) return x.toExponential(digits - 1).replace("e+", "e");
  return Number(x.toPrecision(digits)).toLocaleString("en-US", { maximumFractionDigits: 8 });
}

function el(tag, attrs = {}, text = "") {
  const node = ["svg", "rect", "line", "text", "g", "polyline", "title", "circle"].includes(tag)
    ? document.createElementNS(SVG, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== "") node.textContent = text;
  return node;
}

function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); return node; }

// A request whose `signal` is aborted (newer input superseded it) answers [0, {aborted: true}]; the
// server then sees the connection close and stops its search.
async function call(method, url, body, signal) {
  const init = { method, headers: { "Content-Type": "application/json" }, signal };
  if (body !== undefined) init.body = JSON.stringify(body);
  try {
    const response = await fetch(url, init);
    return [response.status, await response.json()];
  } catch (e) {
    if (e.name === "AbortError") return [0, { aborted: true, error: "superseded by newer input" }];
    return [0, { error: `no answer from the server: ${e}` }];
  }
}

// One request at a time per purpose: `next()` aborts the one before and gives the new one's signal.
function latest() {
  let controller = null;
  return {
    next() { if (controller) controller.abort(); controller = new AbortController(); return controller.signal; },
    abort() { if (controller) controller.abort(); controller = null; },
  };
}
