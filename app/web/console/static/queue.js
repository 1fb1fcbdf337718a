// Queue: what runs now, then the waiting requests in the order their estimated
// starts simulate (the server's one order), one page
// at a time (the server sends only that window), polled every second.
import { api } from "./api.js";
import { bandTag, clock, confirmed, duration, flash, h, points, storyLink, table, words } from "./dom.js";

const PAGE = 100;
const POLL_MS = 1000;

export async function render(main, info) {
  if (!info.live) {
    main.append(
      h("h1", {}, "Queue"),
      h("p", {}, "This is a copy of a log (gpulane ui --db): there is no live queue. ",
        "The Timeline, History and each request's story are drawn from the log."),
    );
    return;
  }
  let offset = 0;
  const running = h("section", { id: "running" });
  const waiting = h("section", { id: "waiting" });
  const pager = h("div", { class: "pager" });
  main.append(h("h1", {}, "Queue"), running, h("h2", { id: "waiting-title" }, "Waiting"), pager, waiting);

  const cancel = async (id, was) => {
    if (!confirmed(`Cancel ${was} request ${id}? It is recorded as cancelled (reason explicit).`)) return;
    try {
      const done = await api("/api/requests/" + encodeURIComponent(id), { method: "DELETE" });
      flash(`Cancelled ${id} (it was ${done.was}).`);
    } catch (error) {
      flash(`Not cancelled: ${error.message}`, true);
    }
    tick();
  };

  const draw = (view) => {
    const runRows = view.running.map((r) =>
      h("tr", { "data-id": r.request_id },
        h("td", {}, storyLink(r.request_id)),
        h("td", {}, r.model, r.loading ? h("span", { class: "muted" }, " (loading)") : null),
        h("td", {}, r.caller || "–"),
        h("td", {}, bandTag(r.band), " ", r.priority),
        h("td", {}, duration(r.for_s)),
        // A run past every run of its model: no end is known, and none is made up.
        h("td", { class: "expected-end" }, r.expected_end_open
          ? h("span", { class: "muted", title: "it has run longer than any run of its model" }, "unknown: longer than any run of its model")
          : clock(r.expected_end_at),
          // A job that reports its progress (a render's steps): the end follows it.
          r.progress ? h("span", { class: "muted", title: "as the job last reported it" }, ` (${r.progress[0]}/${r.progress[1]} done)`) : null),
        h("td", {}, h("button", { class: "danger", onclick: () => cancel(r.request_id, "running") }, "Cancel")),
      ),
    );
    running.replaceChildren(
      h("h2", {}, "Running"),
      view.running.length
        ? table(["request", "model", "caller", "band", "elapsed", "expected end", ""], runRows)
        : h("p", { class: "muted" }, view.loading ? `Loading ${view.loading}.` : "The GPU is idle."),
    );
    const terms = view.terms;
    const rows = view.waiting.map((w) =>
      h("tr", { "data-id": w.request_id },
        h("td", { class: "num" }, w.position),
        h("td", {}, storyLink(w.request_id)),
        h("td", {}, w.model),
        h("td", {}, w.caller || "–"),
        h("td", {}, bandTag(w.band)),
        // Behind a run whose end is unknown: the earliest it can start.
        h("td", { class: "start" }, w.estimated_start_open
          ? [h("span", {}, `after ${clock(w.estimated_start_at)}`), h("span", { class: "muted" }, `at least ${duration(w.estimated_start_in_s)}`)]
          : [h("span", {}, clock(w.estimated_start_at)), h("span", { class: "muted" }, `in ${duration(w.estimated_start_in_s)}`)]),
        h("td", { class: "num" }, duration(w.waited_s)),
        terms.map((t) => h("td", { class: "num term", "data-term": t }, points(w.score[t] ?? 0))),
        h("td", { class: "num" }, points(w.score.total)),
        // Request ids shortened as the request column shows them; the link has the whole id.
        h("td", { class: "waits-for" }, w.waits_for ? w.waits_for.text.replace(/\b([0-9a-f]{8})[0-9a-f]{24}\b/g, "$1") : "–"),
        h("td", { class: "reason" }, w.reason),
        h("td", {}, h("button", { class: "danger", onclick: () => cancel(w.request_id, "waiting") }, "Cancel")),
      ),
    );
    document.getElementById("waiting-title").textContent = `Waiting (${view.total_waiting})`;
    waiting.replaceChildren(
      view.total_waiting
        ? table(["#", "request", "model", "caller", "band", "estimated start", "waited", ...terms.map((t) => [words(t), t]), "score", "waits for", "reason", ""], rows, { id: "waiting-table" })
        : h("p", { class: "muted" }, "Nothing waits."),
    );
    const last = Math.min(view.total_waiting, offset + view.waiting.length);
    pager.replaceChildren(
      h("button", { disabled: offset === 0, onclick: () => { offset = Math.max(0, offset - PAGE); tick(); } }, "◀ earlier"),
      h("span", {}, view.total_waiting ? ` positions ${offset + 1}–${last} of ${view.total_waiting} ` : " "),
      h("button", { disabled: last >= view.total_waiting, onclick: () => { offset += PAGE; tick(); } }, "later ▶"),
      h("span", { class: "muted" }, ` · ${view.scheduler} · resident ${view.resident || "none"} · as of ${clock(view.as_of)}`),
    );
  };

  let timer = null;
  let generation = 0;
  // One poll loop: the next poll is scheduled when the newest one has drawn.
  const tick = async () => {
    const mine = ++generation;
    clearTimeout(timer);
    try {
      const view = await api(`/ui/api/queue?offset=${offset}&limit=${PAGE}`);
      if (mine !== generation) return;
      if (offset > 0 && offset >= view.total_waiting) {
        offset = Math.max(0, Math.floor((view.total_waiting - 1) / PAGE) * PAGE);
      }
      draw(view);
    } catch (error) {
      flash(`Queue not updated: ${error.message}`, true);
    }
    if (mine === generation) timer = setTimeout(tick, POLL_MS);
  };
  await tick();
}
