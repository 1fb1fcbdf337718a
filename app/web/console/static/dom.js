// Building DOM nodes from data. Text goes in as text nodes only (never
// innerHTML), so a model name or caller label can never become markup.
const SVG_NS = "http://www.w3.org/2000/svg";

function fill(el, attrs, children) {
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else el.setAttribute(name === "className" ? "class" : name, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export const h = (tag, attrs, ...children) => fill(document.createElement(tag), attrs, children);
export const s = (tag, attrs, ...children) =>
  fill(document.createElementNS(SVG_NS, tag), attrs, children);

export function table(headers, rows, attrs = {}) {
  // A header is its text, or [text, title].
  const th = (x) => (Array.isArray(x) ? h("th", { title: x[1] }, x[0]) : h("th", {}, x));
  return h(
    "table",
    attrs,
    h("thead", {}, h("tr", {}, headers.map(th))),
    h("tbody", {}, rows),
  );
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const sign = seconds < 0 ? "-" : "";
  let x = Math.abs(seconds);
  if (x < 1) return sign + Math.round(x * 1000) + " ms";
  if (x < 60) return sign + x.toFixed(1) + " s";
  if (x < 3600) return sign + Math.floor(x / 60) + " min " + Math.round(x % 60) + " s";
  x = Math.round(x / 60);
  return sign + Math.floor(x / 60) + " h " + (x % 60) + " min";
}

// Times in UTC, as the CLI prints them, and saying so.
export function clock(unix) {
  if (unix === null || unix === undefined) return "–";
  return new Date(unix * 1000).toISOString().slice(11, 19) + " UTC";
}

export function stamp(unix) {
  if (unix === null || unix === undefined) return "–";
  const iso = new Date(unix * 1000).toISOString();
  return iso.slice(0, 10) + " " + iso.slice(11, 19) + " UTC";
}

// A score term's field name in words (`fair_share` -> "fair share"); the field
// name stays in the header's title.
export const words = (name) => name.replaceAll("_", " ");

export const points = (x) => (Number.isInteger(x) ? String(x) : x.toFixed(2));

export function storyLink(id) {
  return h("a", { href: "/ui/requests/" + encodeURIComponent(id), title: id }, id.slice(0, 8));
}

export const bandTag = (band) => h("span", { class: "band band-" + band }, band);

export function flash(text, error = false) {
  const el = document.getElementById("flash");
  el.textContent = text;
  el.className = error ? "error" : "ok";
  el.hidden = false;
}

export function confirmed(question) {
  // The browser's own dialog: it cannot be styled away or clicked through by a script.
  return window.confirm(question);
}
