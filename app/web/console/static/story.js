// Request story: `explain` of one request as a page, then its raw events.
import { api } from "./api.js";
import { bandTag, clock, confirmed, duration, flash, h, points, s, stamp, storyLink, table } from "./dom.js";

const CAUSE_TEXT = {
  running_at_arrival: "behind the job running when it arrived",
  higher_band: "overtaken: higher band",
  higher_tier: "overtaken: higher priority in its band",
  swap_affinity: "overtaken: its model was loaded (swap affinity)",
  aging: "overtaken: waited longer (aging)",
  arrived_earlier: "behind requests that arrived earlier",
  swaps: "model swaps",
  slot: "waited for a free slot of its model",
  drain: "waited while a model drained",
  evicted: "its model evicted for another request",
  load_backoff: "its model backing off after failed loads",
  restart: "server down (restart)",
  earlier_attempts: "earlier attempts",
  other: "other",
};

const terms = (score) => Object.keys(score).filter((k) => k !== "total");
// A user key's story names no other caller's request (app/report/visibility.py).
const OTHER = "another caller's request";
const who = (id, other) => (other ? OTHER : storyLink(id));

export async function render(main, info, id) {
  const path = "/api/requests/" + encodeURIComponent(id);
  let story;
  let events;
  try {
    [story, events] = await Promise.all([api(path + "/explain"), api("/ui/api/requests/" + encodeURIComponent(id) + "/events")]);
  } catch (error) {
    main.append(h("h1", {}, "Request ", h("code", {}, id)), h("p", { class: "error" }, error.message));
    return;
  }
  const facts = [
    ["status", h("span", { class: "status status-" + story.status, id: "story-status" }, story.status)],
    ["model", story.model || story.model_requested || "–"],
    ["caller", story.caller || "anonymous"],
    ["priority", [bandTag(story.band), " ", story.priority, story.requested_priority !== null && story.requested_priority !== story.priority ? ` (asked ${story.requested_priority})` : "",
      // A header that could not be read, as explain says it.
      story.priority_unreadable ? h("span", { id: "story-unreadable" }, ` · asked '${story.priority_unreadable}' (unreadable, used ${story.priority})`) : ""]],
    ["endpoint", story.endpoint],
    ["arrived", stamp(story.arrived_at)],
    ["waited", h("span", { id: "story-waited" }, duration(story.wait_s))],
    // Arrival to its start: the wait above, then its own load (docs/queries.md).
    ["time to start", h("span", { id: "story-time-to-start" }, story.time_to_start_s === null || story.time_to_start_s === undefined
      ? "–" : `${duration(story.time_to_start_s)}` + (story.own_swap ? " (its wait, then its own load)" : ""))],
    ["started", story.started_at ? stamp(story.started_at) : "–"],
    ["ran", duration(story.run_s)],
    ["total", duration(story.total_s)],
    ["scheduler", `${story.scheduler} (aging ÷${story.aging_divisor_s} s, affinity +${story.swap_affinity_bonus})`],
  ];
  if (story.outcome) {
    const o = story.outcome;
    facts.push(["outcome", `${o.status} at ${clock(o.at)}` + (o.http_status ? ` · HTTP ${o.http_status}` : "") + (o.error ? ` · ${o.error}` : "") + (o.cancel_reason ? ` · reason ${o.cancel_reason}` : "")]);
  }
  if (story.batch) {
    const b = story.batch;
    const p = b.progress;
    const within = p && p.estimated_finish_low_at != null ? ` (80% between ${clock(p.estimated_finish_low_at)} and ${p.estimated_finish_high_at === null ? "?" : clock(p.estimated_finish_high_at)})` : "";
    const eta = p && p.estimated_finish_at !== null ? `, expected to end at ${clock(p.estimated_finish_at)}${within}` : "";
    facts.push(["batch", [h("a", { href: "/ui/batches/" + encodeURIComponent(b.id), id: "story-batch" }, b.id), p ? ` · ${p.done + p.failed} of ${p.total} ended${eta}` : ""]]);
  }
  if (story.chain) {
    const c = story.chain;
    const p = c.progress;
    const of = c.length !== null && c.length !== undefined ? ` of ${c.length}` : "";
    const href = "/ui/chains/" + encodeURIComponent(c.id) + (info.caller || !story.caller ? "" : "?caller=" + encodeURIComponent(story.caller));
    const within = p && p.estimated_finish_low_at != null ? ` (80% between ${clock(p.estimated_finish_low_at)} and ${p.estimated_finish_high_at === null ? "?" : clock(p.estimated_finish_high_at)})` : "";
    const eta = p && p.estimated_finish_at !== null ? `, the chain expected to end at ${clock(p.estimated_finish_at)}${within}` : "";
    facts.push(["chain", [`shot ${c.shot}${of} of `, h("a", { href, id: "story-chain" }, c.id), eta]]);
  }
  if (story.waiting) {
    const w = story.waiting;
    facts.push(["position", w.estimated_start_open
      ? `${w.position} of ${w.queue_depth}, to start after ${clock(w.estimated_start_at)} at the earliest (at least ${duration(w.estimated_start_in_s)}: behind a run longer than any run of its model, its end unknown)`
      : `${w.position} of ${w.queue_depth}, expected to start at ${clock(w.estimated_start_at)} (in ${duration(w.estimated_start_in_s)})`]);
  }
  const actions = [];
  if (info.live && (story.status === "queued" || story.status === "running")) {
    actions.push(h("button", { class: "danger", onclick: async () => {
      if (!confirmed(`Cancel request ${id}? It is recorded as cancelled (reason explicit).`)) return;
      try {
        const done = await api(path, { method: "DELETE" });
        flash(`Cancelled ${id} (it was ${done.was}).`);
      } catch (error) {
        flash(`Not cancelled: ${error.message}`, true);
      }
    } }, "Cancel this request"));
  }
  const sections = [
    h("h1", {}, "Request ", h("code", { id: "story-id" }, story.request_id)),
    h("dl", { class: "facts" }, facts.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])),
    ...actions,
    waitSplit(story),
    decisions(story),
    ahead(story),
    swaps(story),
    raw(events.events),
  ];
  main.append(...sections.filter(Boolean));
  if (!story.replay_matches) main.prepend(h("p", { class: "error" }, "The replayed log does not reproduce every recorded decision: this story may be incomplete."));
}

function waitSplit(story) {
  const parts = story.wait || [];
  if (!parts.length) return h("section", {}, h("h2", {}, "Wait"), h("p", { class: "muted" }, "It did not wait."));
  let x = 0;
  const bar = s("svg", { viewBox: "0 0 1000 24", class: "split", role: "img", "aria-label": "wait by cause" },
    parts.map((p) => {
      const w = (p.percent / 100) * 1000;
      const rect = s("rect", { class: "cause cause-" + p.cause, x, y: 0, width: Math.max(1, w), height: 24 }, s("title", {}, `${CAUSE_TEXT[p.cause] || p.cause}: ${duration(p.seconds)}`));
      x += w;
      return rect;
    }));
  return h("section", {}, h("h2", {}, `Wait: ${duration(story.wait_s)}, by cause`), bar,
    table(["cause", "time", "share"], parts.map((p) => h("tr", {}, h("td", {}, h("span", { class: "swatch cause-" + p.cause }), " ", CAUSE_TEXT[p.cause] || p.cause), h("td", { class: "num" }, duration(p.seconds)), h("td", { class: "num" }, p.percent.toFixed(1) + " %")))));
}

function decisions(story) {
  if (!story.decisions.length) return null;
  const names = terms(story.decisions[0].score);
  const rows = story.decisions.map((d) => h("tr", { class: d.winner_id === story.request_id ? "won" : "" },
    h("td", {}, clock(d.at)), h("td", { class: "num" }, d.queue_depth), h("td", {}, d.resident || "–"),
    names.map((t) => h("td", { class: "num" }, points(d.score[t] ?? 0))), h("td", { class: "num" }, points(d.score.total)),
    h("td", {}, d.winner_id === story.request_id ? "this request" : who(d.winner_id, d.winner_another_caller)), h("td", { class: "num" }, points(d.winner.total)),
    h("td", {}, d.reason || "won"), h("td", {}, d.matches_record ? "✓" : "✗")));
  return h("section", {}, h("h2", {}, "Its score at each decision"),
    table(["at", "waiting", "resident", ...names, "score", "winner", "winner's score", "why", "replay"], rows));
}

function ahead(story) {
  const rows = [
    ...story.running_at_arrival.map((r) => h("tr", {}, h("td", {}, who(r.request_id, r.another_caller)), h("td", {}, r.model), h("td", {}, bandTag(r.band)), h("td", {}, "running when it arrived"), h("td", { class: "num" }, duration(r.held_s)))),
    ...story.ahead.map((a) => h("tr", {}, h("td", {}, who(a.request_id, a.another_caller)), h("td", {}, a.model), h("td", {}, bandTag(a.band)), h("td", {}, a.reasons.join(", ")), h("td", { class: "num" }, duration(a.held_s)))),
  ];
  if (!rows.length) return null;
  return h("section", {}, h("h2", {}, "Who went first, and by which term"), table(["request", "model", "band", "won by", "held the GPU"], rows));
}

function swaps(story) {
  const all = [...story.swaps];
  if (story.own_swap) all.push({ ...story.own_swap, own: true });
  if (!all.length) return null;
  return h("section", {}, h("h2", {}, "Swaps"), table(["", "from → to", "caused by", "started", "took", "of its wait"],
    all.map((w) => h("tr", {}, h("td", {}, w.own ? "its own" : "waited for"), h("td", {}, `${w.from_model || "nothing"} → ${w.to_model}`),
      h("td", {}, w.request_id || w.another_caller ? who(w.request_id, w.another_caller) : "preload"), h("td", {}, clock(w.started_at)),
      h("td", { class: "num" }, w.error ? "failed: " + w.error : duration(w.duration_s)), h("td", { class: "num" }, duration(w.waited_s))))));
}

function raw(events) {
  return h("section", {}, h("h2", {}, `Raw events (${events.length})`),
    table(["seq", "at", "type", "data"], events.map((e) => h("tr", { class: "event" }, h("td", { class: "num" }, e.seq), h("td", {}, clock(e.at)), h("td", {}, e.type), h("td", {}, h("pre", {}, JSON.stringify(e.data, null, 1)))))));
}
