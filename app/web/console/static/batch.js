// Batch page: its progress (a bar and the estimated finish, with what it rests on),
// then its lines, each linked to its request's story.
import { api } from "./api.js";
import { duration, h, stamp, storyLink, table } from "./dom.js";

const PAGE = 200;

export async function render(main, info, id) {
  const path = "/v1/batches/" + encodeURIComponent(id);
  let batch;
  try {
    batch = await api(path);
  } catch (error) {
    main.append(h("h1", {}, "Batch ", h("code", {}, id)), h("p", { class: "error" }, error.message));
    return;
  }
  const p = batch.gpulane_progress;
  const facts = [
    ["status", h("span", { class: "status status-" + batch.status, id: "batch-status" }, batch.status)],
    ["caller", batch.caller || "anonymous"],
    ["endpoint", batch.endpoint],
    ["priority", batch.priority],
    ["created", stamp(batch.created_at)],
    ["expires", stamp(batch.expires_at)],
  ];
  const sections = [h("h1", {}, "Batch ", h("code", { id: "batch-id" }, batch.id)), h("dl", { class: "facts" }, facts.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]))];
  if (p) sections.push(progressSection(p, batch.status));
  main.append(...sections);
  const lines = h("section", { id: "batch-lines" }, h("h2", {}, "Lines"));
  main.append(lines);
  await drawLines(lines, id, 0);
}

// A batch that has ended (whatever became of its lines) shows a full bar.
const ENDED = new Set(["completed", "failed", "cancelled", "expired"]);

function progressSection(p, status) {
  const ended = ENDED.has(status) ? Math.max(1, p.total) : p.done + p.failed;
  const summary = `${p.done} done, ${p.running} running, ${p.waiting} waiting, ${p.failed} failed of ${p.total}`;
  const parts = [
    h("h2", {}, "Progress"),
    h("progress", { id: "batch-progress", max: Math.max(1, p.total), value: ended, "aria-label": summary }, `${ended} / ${p.total}`),
    h("p", { id: "batch-summary" }, summary),
  ];
  if (p.estimated_finish_at !== null && p.basis) {
    const b = p.basis;
    const runs = Object.entries(b.run_s).map(([m, x]) => `${m} ${duration(x)}`).join(", ");
    const forecast = p.estimated_finish_low_at !== null && p.estimated_finish_low_at !== undefined;
    const interval = forecast ? ` 80% between ${stamp(p.estimated_finish_low_at)} and ${p.estimated_finish_high_at === null ? "later (too little log to say)" : stamp(p.estimated_finish_high_at)}.` : "";
    parts.push(h("p", { id: "batch-eta" }, `Expected to end at ${stamp(p.estimated_finish_at)} (in ${duration(p.estimated_finish_in_s)}).${interval}`));
    const later = !forecast ? " Work that arrives later and goes first is not foreseen."
      : b.earlier_days ? ` Forecast from the same hours of ${b.earlier_days} earlier day${b.earlier_days === 1 ? "" : "s"}: ${b.overtaking} requests expected to arrive and go first.`
      : " No earlier day in the log to forecast the work that arrives later from: the estimate is the queue as it stands, the interval today's rate going on.";
    parts.push(h("p", { class: "muted", id: "batch-basis" }, `From the queue as it stands: ${b.ahead} other requests expected first, ${b.swaps} model loads, median run ${runs}` + (b.unqueued ? `, ${b.unqueued} lines not queued yet` : "") + "." + later));
  }
  return h("section", {}, parts);
}

async function drawLines(section, id, offset) {
  const page = await api(`/ui/api/batches/${encodeURIComponent(id)}/lines?offset=${offset}&limit=${PAGE}`);
  const rows = page.data.map((l) => h("tr", {},
    h("td", { class: "num" }, l.line), h("td", {}, l.custom_id), h("td", {}, l.model || "–"),
    h("td", {}, l.request_id ? storyLink(l.request_id) : "–"),
    h("td", {}, h("span", { class: "status status-" + l.status }, l.status)),
    h("td", {}, l.error || "")));
  const more = page.offset + page.data.length < page.total;
  section.replaceChildren(h("h2", {}, `Lines ${page.offset + 1}–${page.offset + page.data.length} of ${page.total}`),
    table(["line", "custom_id", "model", "request", "status", "error"], rows),
    h("p", {},
      page.offset > 0 ? h("button", { onclick: () => drawLines(section, id, Math.max(0, page.offset - PAGE)) }, "Previous") : null,
      more ? h("button", { onclick: () => drawLines(section, id, page.offset + PAGE) }, "Next") : null));
}
