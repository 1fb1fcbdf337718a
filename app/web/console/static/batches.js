// Batches: the newest first (GET /v1/batches, a user key its own), each linked
// to its page with a bar of its lines ended.
import { api } from "./api.js";
import { h, stamp, table } from "./dom.js";

const PAGE = 50;

export async function render(main, info) {
  main.append(h("h1", {}, "Batches"));
  if (!info.live) {
    main.append(h("p", {}, "This is a copy of a log (gpulane ui --db): batches are listed by a live server."));
    return;
  }
  const body = h("section", { id: "batches" });
  main.append(body);
  const draw = async (after) => {
    const page = await api(`/v1/batches?limit=${PAGE}` + (after ? `&after=${encodeURIComponent(after)}` : ""));
    const rows = page.data.map((b) => {
      const p = b.gpulane_progress;
      const total = b.request_counts ? b.request_counts.total : p ? p.total : 0;
      const ended = b.request_counts ? b.request_counts.completed + b.request_counts.failed : 0;
      return h("tr", { "data-id": b.id },
        h("td", {}, h("a", { href: "/ui/batches/" + encodeURIComponent(b.id) }, b.id)),
        h("td", {}, h("span", { class: "status status-" + b.status }, b.status)),
        h("td", {}, b.caller || "–"),
        h("td", {}, b.endpoint),
        h("td", { class: "num" }, `${ended} / ${total}`),
        h("td", {}, stamp(b.created_at)));
    });
    body.replaceChildren(
      page.data.length
        ? table(["batch", "status", "caller", "endpoint", "lines ended", "created"], rows)
        : h("p", { class: "muted" }, "No batches yet (docs/jobs.md: POST /v1/batches)."),
      page.has_more ? h("button", { onclick: () => draw(page.last_id) }, "Older ▶") : "",
    );
  };
  await draw(null);
}
