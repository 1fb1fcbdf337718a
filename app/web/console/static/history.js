// History: finished requests with filters, and wait percentiles per band over
// the same window as a small chart.
import { api } from "./api.js";
import { bandTag, duration, h, s, stamp, storyLink, table } from "./dom.js";

const PAGE = 50;
const STATUSES = ["", "completed", "failed", "cancelled", "abandoned", "rejected"];
const BANDS = ["", "interactive", "normal", "batch"];
const HOURS = [["1", "last hour"], ["24", "last day"], ["168", "last week"], ["720", "last 30 days"]];

export async function render(main) {
  const field = (label, input) => h("label", {}, label, " ", input);
  const select = (name, values, labels) => h("select", { name }, values.map((v, i) => h("option", { value: v }, labels ? labels[i] : v || "any")));
  const form = h("form", { class: "controls", id: "filters" },
    field("model", h("input", { name: "model", size: 12 })),
    field("band", select("band", BANDS)),
    field("caller", h("input", { name: "caller", size: 10 })),
    field("status", select("status", STATUSES)),
    field("window", select("hours", HOURS.map((x) => x[0]), HOURS.map((x) => x[1]))),
    h("button", { type: "submit" }, "Filter"));
  form.elements.hours.value = "24";
  const chart = h("section", { id: "percentiles" });
  const rows = h("section", { id: "history" });
  const pager = h("div", { class: "pager" });
  main.append(h("h1", {}, "History"), form, chart, pager, rows);
  let offset = 0;

  async function load() {
    const params = new URLSearchParams();
    for (const [k, v] of new FormData(form)) if (v) params.set(k, v);
    params.set("limit", PAGE);
    params.set("offset", offset);
    const data = await api("/ui/api/history?" + params);
    chart.replaceChildren(h("h2", {}, "Wait percentiles by band"), percentileChart(data.percentiles));
    rows.replaceChildren(table(["request", "finished", "model", "caller", "band", "status", "waited", "ran"],
      data.rows.map((r) => h("tr", { "data-id": r.id }, h("td", {}, storyLink(r.id)), h("td", {}, stamp(r.finished_at)), h("td", {}, r.model || "–"),
        h("td", {}, r.caller || "–"), h("td", {}, bandTag(r.band)), h("td", {}, r.status + (r.http_status ? ` (${r.http_status})` : "")),
        h("td", { class: "num" }, duration(r.queue_wait_ms === null ? null : r.queue_wait_ms / 1000)),
        h("td", { class: "num" }, duration(r.run_ms === null ? null : r.run_ms / 1000))))));
    const last = offset + data.rows.length;
    pager.replaceChildren(
      h("button", { disabled: offset === 0, onclick: () => { offset = Math.max(0, offset - PAGE); load(); } }, "◀ newer"),
      h("span", {}, data.total ? ` ${offset + 1}–${last} of ${data.total} ` : " no finished requests in this window "),
      h("button", { disabled: last >= data.total, onclick: () => { offset += PAGE; load(); } }, "older ▶"));
  }
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    offset = 0;
    load().catch((error) => rows.replaceChildren(h("p", { class: "error" }, error.message)));
  });
  await load();
}

function percentileChart(percentiles) {
  const bands = Object.keys(percentiles);
  if (!bands.length) return h("p", { class: "muted" }, "No waits to chart in this window.");
  const max = Math.max(0.001, ...bands.flatMap((b) => [percentiles[b].p99]));
  const W = 600, ROW = 54, LEFT = 110;
  const items = [];
  bands.forEach((band, i) => {
    const p = percentiles[band];
    const y = i * ROW + 8;
    items.push(s("text", { x: 0, y: y + 22, class: "chart-label" }, `${band} (${p.count})`));
    ["p50", "p90", "p99"].forEach((k, j) => {
      const w = Math.max(1, (p[k] / max) * (W - LEFT - 90));
      items.push(s("rect", { class: `pbar band-${band} ${k}`, x: LEFT, y: y + j * 14, width: w, height: 12 }, s("title", {}, `${band} ${k}: ${duration(p[k])}`)));
      items.push(s("text", { x: LEFT + w + 6, y: y + j * 14 + 10, class: "chart-value" }, `${k} ${duration(p[k])}`));
    });
  });
  return s("svg", { viewBox: `0 0 ${W} ${bands.length * ROW + 10}`, class: "chart", role: "img", "aria-label": "wait percentiles by band" }, items);
}
