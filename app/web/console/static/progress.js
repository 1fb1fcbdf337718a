// A run's progress, as a batch page and a chain page show it: a bar, the counts,
// and the estimated finish (app/report/progress.py, the one estimator) with what
// it rests on, and its 80% interval and the overtaking work it foresees when the
// estimate gives them.
import { duration, h, stamp } from "./dom.js";

// `prefix` names the elements (batch-progress, chain-eta, ...); `ended`: the
// run has ended whatever became of its parts (a full bar); `unit`: "lines" or
// "shots". `p.total` is null for a chain whose length was not given.
export function progressSection(p, { prefix, ended = false, unit = "lines" }) {
  const known = p.total !== null && p.total !== undefined;
  const total = known ? p.total : p.done + p.failed + p.running + p.waiting;
  const over = ended ? Math.max(1, total) : p.done + p.failed;
  const summary = `${p.done} done, ${p.running} running, ${p.waiting} waiting, ${p.failed} failed of ${known ? total : total + " so far (length not given)"}`;
  const parts = [
    h("h2", {}, "Progress"),
    h("progress", { id: prefix + "-progress", max: Math.max(1, total), value: over, "aria-label": summary }, `${over} / ${total}`),
    h("p", { id: prefix + "-summary" }, summary),
  ];
  if (p.estimated_finish_at !== null && p.basis) {
    const b = p.basis;
    const runs = Object.entries(b.run_s).map(([m, x]) => `${m} ${duration(x)}`).join(", ");
    // The interval and the forecast of overtaking work, when the estimate gives them.
    const forecast = p.estimated_finish_low_at !== null && p.estimated_finish_low_at !== undefined;
    const late = p.estimated_finish_open ? "later (a run has no known end)" : "later (too little log to say)";
    const interval = forecast ? ` 80% between ${stamp(p.estimated_finish_low_at)} and ${p.estimated_finish_high_at === null ? late : stamp(p.estimated_finish_high_at)}.` : "";
    // Behind a run longer than any run of its model: the least it can be, said so.
    const eta = p.estimated_finish_open
      ? `Expected to end after ${stamp(p.estimated_finish_at)} at the earliest (at least ${duration(p.estimated_finish_in_s)}): a run has gone longer than any run of its model, its end unknown.`
      : `Expected to end at ${stamp(p.estimated_finish_at)} (in ${duration(p.estimated_finish_in_s)}).`;
    parts.push(h("p", { id: prefix + "-eta" }, `${eta}${interval}`));
    const later = !forecast ? " Work that arrives later and goes first is not foreseen."
      : b.earlier_days ? ` Forecast from the same hours of ${b.earlier_days} earlier day${b.earlier_days === 1 ? "" : "s"}: ${b.overtaking} requests expected to arrive and go first.`
      : ` No earlier day in the log: ${b.overtaking} requests expected to arrive and go first, from today's rate so far (none with under half an hour of it, or after a quiet night); the interval's late end is that rate going on.`;
    parts.push(h("p", { class: "muted", id: prefix + "-basis" }, `From the queue as it stands: ${b.ahead} other requests expected first, ${b.swaps} model loads, median run ${runs}` + (b.unqueued ? `, ${b.unqueued} ${unit} not queued yet` : "") + "." + later));
  }
  return h("section", {}, parts);
}
