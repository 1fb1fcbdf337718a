// GPU timeline: one row per model, so parallel work (several lanes, several
// slots) shows side by side; a bar per request coloured by band (a model's
// overlapping requests stacked in its row, one track per slot in use), its
// loads hatched, idle time left empty. Hover tells, click opens the story.
// Each load says the GPU memory the model held while resident (its footprint, as
// the log recorded it), and the row's label its largest in the window; on a live
// server the models page's memory bar stands above the chart.
import { api } from "./api.js";
import { clock, duration, h, s, stamp } from "./dom.js";
import { gib, memoryBar } from "./models.js";

const WIDTH = 1200;
const LANE_Y = 24;
const LANE_H = 56;
const TRACK_H = 22; // the row grows by this for every further overlapping request
const ROW_GAP = 8;
const LABEL_W = 110; // the model names, left of the rows
// The default fits the data: since the log starts, at most the last hour, so a
// fresh server's first minutes fill the chart.
const WINDOWS = [["fit", "since the log starts (at most an hour)"], ["0.25", "last 15 min"], ["1", "last hour"], ["6", "last 6 hours"], ["24", "last day"], ["whole", "whole log"], ["custom", "custom…"]];

// The custom window's inputs are in UTC, like every time on the console.
function utcInput(unix) {
  return new Date(unix * 1000).toISOString().slice(0, 16);
}

export async function render(main, info) {
  const choice = h("select", { id: "window" }, WINDOWS.map(([v, t]) => h("option", { value: v, selected: v === "fit" }, t)));
  const from = h("input", { type: "datetime-local", id: "from", hidden: true });
  const to = h("input", { type: "datetime-local", id: "to", hidden: true });
  const refresh = h("button", { type: "submit" }, "Show");
  const controls = h("form", { class: "controls" }, "Window (UTC) ", choice, from, to, refresh);
  const chart = h("div", { id: "timeline" });
  const hover = h("p", { id: "hover", class: "muted" }, "Hover a bar to see the request; click it to open its story.");
  const summary = h("p", { id: "summary" });
  const memory = h("div", { id: "timeline-memory" });
  main.append(h("h1", {}, "GPU timeline"), memory, controls, summary, chart, hover, legend());

  choice.addEventListener("change", () => {
    from.hidden = to.hidden = choice.value !== "custom";
  });
  controls.addEventListener("submit", (event) => {
    event.preventDefault();
    load();
  });

  async function load() {
    let query;
    if (choice.value === "custom" && from.value && to.value) {
      query = `since=${Date.parse(from.value + "Z") / 1000}&until=${Date.parse(to.value + "Z") / 1000}`;
    } else if (choice.value === "whole") {
      query = "whole=true";
    } else if (choice.value === "fit" || choice.value === "custom") {
      query = "hours=1&fit=true";
    } else {
      query = `hours=${choice.value}`;
    }
    const data = await api("/ui/api/timeline?" + query);
    if (info && info.live) {
      // The GPU now, as on the models page; the chart may show the past, so it is only a header.
      const models = await api("/ui/api/models").catch(() => null);
      memory.replaceChildren(memoryBar(models && models.memory) ?? "");
    }
    if (choice.value !== "custom") {
      from.value = utcInput(data.since);
      to.value = utcInput(data.until);
    }
    draw(data);
  }

  function draw(data) {
    const span = Math.max(1e-6, data.until - data.since);
    const x = (t) => LABEL_W + ((Math.min(Math.max(t, data.since), data.until) - data.since) / span) * WIDTH;
    const clip = (a, b) => [Math.max(a, data.since), Math.min(b, data.until)];
    // One row per model, by name (a stable order from one window to the next); a model's overlapping
    // requests (its slots) stack within its row, one track each.
    const rows = new Map();
    const row = (model) => {
      if (!rows.has(model)) rows.set(model, { model, swaps: [], requests: [], tracks: [] });
      return rows.get(model);
    };
    const busy = [];
    for (const sw of data.swaps) {
      const end = sw.finished_at ?? data.now;
      row(sw.to_model).swaps.push(sw);
      busy.push(clip(sw.started_at, end));
    }
    for (const r of data.requests) {
      const start = r.started_at ?? r.dispatched_at;
      const end = r.finished_at ?? data.now;
      const into = row(r.model);
      let track = into.tracks.findIndex((last) => last <= start);
      if (track < 0) track = into.tracks.push(end) - 1;
      else into.tracks[track] = end;
      into.requests.push({ r, start, end, track });
      busy.push(clip(start, end));
    }
    // A load's footprint: the most the log recorded for its model from the load's
    // start until the model's next load (its residency), in MiB; null: never measured.
    const footprints = data.footprints ?? [];
    for (const lane of rows.values()) {
      lane.swaps.forEach((sw, i) => {
        const next = lane.swaps[i + 1];
        const until = next ? next.started_at : Infinity;
        const held = footprints.filter((f) => f.model === lane.model && f.at >= sw.started_at && f.at <= until);
        sw.mib = held.length ? Math.max(...held.map((f) => f.mib)) : null;
      });
      const known = lane.swaps.filter((sw) => sw.mib !== null);
      lane.mib = known.length ? Math.max(...known.map((sw) => sw.mib)) : null;
    }
    const bars = [];
    let y = LANE_Y;
    for (const lane of [...rows.values()].sort((p, q) => (p.model < q.model ? -1 : p.model > q.model ? 1 : 0))) {
      const depth = Math.max(1, lane.tracks.length);
      const height = LANE_H + (depth - 1) * TRACK_H;
      const group = [
        s("rect", { class: "idle", x: LABEL_W, y, width: WIDTH, height }),
        s("text", { class: "row-label", x: LABEL_W - 8, y: y + height / 2 + (lane.mib === null ? 4 : -2) }, lane.model),
      ];
      if (lane.mib !== null) {
        group.push(s("text", { class: "row-memory", x: LABEL_W - 8, y: y + height / 2 + 12 }, gib(lane.mib),
          s("title", {}, `the most GPU memory ${lane.model} held in this window`)));
      }
      for (const sw of lane.swaps) {
        const x0 = x(sw.started_at);
        const x1 = x(sw.finished_at ?? data.now);
        const held = sw.mib === null ? "" : `, holds ${gib(sw.mib)}`;
        const rect = s("rect", {
          class: "bar swap" + (sw.error ? " failed" : ""), x: x0, y, width: Math.max(1, x1 - x0), height,
          "data-mib": sw.mib,
        }, s("title", {}, `load ${sw.to_model}${held}` + (sw.error ? ` failed: ${sw.error}` : "")));
        rect.addEventListener("mouseenter", () => {
          hover.textContent = `Swap ${sw.from_model || "nothing"} → ${sw.to_model}, ${duration(sw.duration_ms / 1000)} from ${clock(sw.started_at)}` +
            (sw.another_caller ? ", caused by another caller's request" : sw.request_id ? `, caused by ${sw.request_id}` : ", a preload") + held + (sw.error ? ` (failed: ${sw.error})` : "");
        });
        group.push(rect);
      }
      const trackH = (height - 12) / depth;
      for (const { r, start, end, track } of lane.requests) {
        const x0 = x(start);
        const x1 = x(end);
        const label = `${r.id} · ${r.model} · ${r.band} (${r.priority}) · ${r.caller || "anonymous"} · ${r.status}`;
        const rect = s("rect", {
          class: `bar req band-${r.band} status-${r.status}`, "data-id": r.id, "data-track": track,
          x: x0, y: y + 6 + track * trackH, width: Math.max(2, x1 - x0), height: trackH,
          tabindex: 0, role: "link", "aria-label": label,
        }, s("title", {}, label));
        rect.addEventListener("mouseenter", () => {
          hover.textContent = `${label} · waited ${duration((r.queue_wait_ms ?? 0) / 1000)} · ran ${clock(start)}–${r.finished_at ? clock(end) : "now"} (${duration(end - start)})`;
        });
        const open = () => { location.href = "/ui/requests/" + encodeURIComponent(r.id); };
        rect.addEventListener("click", open);
        rect.addEventListener("keydown", (event) => { if (event.key === "Enter") open(); });
        group.push(rect);
      }
      bars.push(s("g", { class: "row", "data-model": lane.model }, group));
      y += height + ROW_GAP;
    }
    if (!rows.size) {
      bars.push(s("rect", { class: "idle", x: LABEL_W, y, width: WIDTH, height: LANE_H }));
      y += LANE_H + ROW_GAP;
    }
    const bottom = y - ROW_GAP;
    const ticks = [];
    for (let i = 0; i <= 6; i++) {
      const t = data.since + (span * i) / 6;
      const tx = LABEL_W + (WIDTH * i) / 6;
      ticks.push(s("line", { class: "tick", x1: tx, x2: tx, y1: LANE_Y, y2: bottom + 4 }));
      ticks.push(s("text", { class: "tick-label", x: Math.min(Math.max(tx, LABEL_W + 30), LABEL_W + WIDTH - 30), y: bottom + 18 }, clock(t).slice(0, 8)));  // the summary says UTC
    }
    chart.replaceChildren(
      s("svg", { viewBox: `0 0 ${LABEL_W + WIDTH} ${bottom + 24}`, class: "lane", role: "img", "aria-label": "GPU timeline, one row per model" },
        s("defs", {}, s("pattern", { id: "hatch", width: 6, height: 6, patternUnits: "userSpaceOnUse", patternTransform: "rotate(45)" },
          s("rect", { class: "hatch-bg", width: 6, height: 6 }), s("line", { class: "hatch-line", x1: 0, y1: 0, x2: 0, y2: 6 }))),
        bars, ticks),
    );
    // Busy: when anything ran or loaded, on any row (parallel work counted once).
    let covered = 0;
    let reach = -Infinity;
    for (const [a, b] of busy.filter(([a, b]) => b > a).sort((p, q) => p[0] - q[0])) {
      covered += Math.max(0, b - Math.max(a, reach));
      reach = Math.max(reach, b);
    }
    const busyS = Math.min(covered, span);
    const idle = span - busyS;
    summary.textContent = `${stamp(data.since)} – ${stamp(data.until)}: ${data.requests.length} requests, ${data.swaps.length} swaps, ${rows.size} models; ` +
      `busy ${duration(busyS)}, idle ${duration(idle)} (${Math.round((100 * idle) / span)}%)` +
      (data.truncated ? " · too many requests: showing the first ones, narrow the window" : "");
  }

  function legend() {
    const item = (cls, text) => h("span", { class: "legend-item" }, s("svg", { width: 14, height: 14 }, s("rect", { class: cls, width: 14, height: 14 })), " ", text);
    return h("p", { class: "legend" }, item("key band-interactive", "interactive"), item("key band-normal", "normal"),
      item("key band-batch", "batch"), item("key swap-key", "swap / load"), item("key idle", "idle"));
  }

  await load();
}
