// Chains: the runs callers send one request at a time (X-Gpulane-Chain), the
// latest to get a shot first (GET /api/chains, a user key its own), each linked
// to its page with a bar of its shots ended.
import { api } from "./api.js";
import { h, stamp, table } from "./dom.js";

export async function render(main, info) {
  main.append(h("h1", {}, "Chains"));
  if (!info.live) {
    main.append(h("p", {}, "This is a copy of a log (gpulane ui --db): chains are listed by a live server."));
    return;
  }
  const page = await api("/api/chains?limit=100");
  const rows = page.data.map((c) => {
    const p = c.progress;
    const href = "/ui/chains/" + encodeURIComponent(c.id) + (info.caller ? "" : "?caller=" + encodeURIComponent(c.caller || ""));
    return h("tr", { "data-id": c.id },
      h("td", {}, h("a", { href: c.caller === null ? "/ui/chains/" + encodeURIComponent(c.id) : href }, c.id)),
      h("td", {}, h("span", { class: "status status-" + c.status }, c.status)),
      h("td", {}, c.caller || "–"),
      h("td", {}, c.model),
      h("td", { class: "num" }, `${p.done + p.failed} / ${p.total === null ? c.sent + "+" : p.total}`),
      h("td", {}, p.estimated_finish_at !== null ? stamp(p.estimated_finish_at) : "–"),
      h("td", {}, stamp(c.last_at)));
  });
  main.append(page.data.length
    ? table(["chain", "status", "caller", "model", "shots ended", "expected end", "latest shot"], rows, { id: "chains" })
    : h("p", { class: "muted" }, "No chains yet (docs/jobs.md, Chains: send X-Gpulane-Chain with each request)."));
}
