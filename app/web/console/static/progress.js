// A run's progress, as a batch page and a chain page show it: a bar, the counts,
// and the estimated finish (app/report/progress.py, the one estimator) with what
// it rests on, and its 80% interval when the estimate gives one.
import { duration, h, stamp } from "./dom.js";

// `prefix` names the elements (batch-progress, chain-eta, ...); `ended`: the
// run has ended whatever became of its parts (a full bar); `unit`: "lines" or
// "shots"; `total`: null when the run's length is not known.
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
    parts.push(h("p", { id: prefix + "-eta" }, `Expected to end at ${stamp(p.estimated_finish_at)} (in ${duration(p.estimated_finish_in_s)}).`));
    if (p.estimated_finish_low_at != null && p.estimated_finish_high_at != null) {
      parts.push(h("p", { id: prefix + "-interval" }, `80% interval: between ${stamp(p.estimated_finish_low_at)} and ${stamp(p.estimated_finish_high_at)}.`));
    }
    const foreseen = b.overtaking != null ? `, ${b.overtaking} expected to arrive later and go first` : "";
    const unforeseen = p.estimated_finish_low_at != null ? "" : " Work that arrives later and goes first is not foreseen.";
    parts.push(h("p", { class: "muted" }, `From the queue as it stands: ${b.ahead} other requests expected first${foreseen}, ${b.swaps} model loads, median run ${runs}` + (b.unqueued ? `, ${b.unqueued} ${unit} not queued yet` : "") + "." + unforeseen));
  }
  return h("section", {}, parts);
}
