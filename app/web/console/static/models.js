// Models: state, aliases, port and upstream address, median load time from the
// log, what waits for each, load and unload (with confirmation, saying what a
// busy model's unload stops), and the upstream's recent output. Polled.
// Above them, a GPU memory bar: the resident models' footprints, memory other
// processes hold, and what is free, over the GPU's total (or the memory router's
// budget without telemetry).
import { api } from "./api.js";
import { confirmed, duration, flash, h, s, table } from "./dom.js";

export function gib(mib) {
  return mib === null || mib === undefined ? "–" : (mib / 1024).toFixed(1) + " GiB";
}

// The bar is SVG: its sizes are attributes, which the console's CSP allows
// (inline styles it does not).
export function memoryBar(memory) {
  if (!memory) return null;
  const gpu = memory.gpu;
  const scale = gpu ? gpu.total_mib : memory.budget_mib;
  const known = memory.resident.filter((r) => r.mib);
  const ours = known.reduce((sum, r) => sum + r.mib, 0);
  const words = [];
  if (gpu) {
    words.push(`GPU memory: ${gib(gpu.used_mib)} of ${gib(gpu.total_mib)} used (${gpu.name})`);
    if (gpu.utilization_pct !== null) words.push(`${gpu.utilization_pct} % busy`);
  } else {
    words.push(`No GPU telemetry: footprints are declared (gpuMemory); resident ${gib(ours)}`);
  }
  if (memory.budget_mib) words.push(`memory router budget ${gib(memory.budget_mib)}`);
  if (!scale) return h("p", { id: "memory", class: "muted" }, words.join(" · "));
  const W = 1000;
  let x = 0;
  const rects = [];
  const segment = (mib, cls, label) => {
    const width = Math.max(0, Math.min(W - x, (mib / scale) * W));
    if (width <= 0) return;
    rects.push(s("rect", { x, y: 0, width, height: 24, class: cls, "data-model": label },
      s("title", {}, `${label}: ${gib(mib)}`)));
    x += width;
  };
  known.forEach((r, i) => segment(r.mib, `mem-model mem-${i % 6}`, r.model));
  if (gpu) segment(Math.max(0, gpu.used_mib - ours), "mem-other", "other processes");
  const marks = [];
  if (gpu && memory.budget_mib) {
    const at = Math.min(W, (memory.budget_mib / scale) * W);
    marks.push(s("line", { x1: at, x2: at, y1: 0, y2: 24, class: "mem-budget" }, s("title", {}, "budget")));
  }
  return h("section", { id: "memory" },
    h("p", {}, words.join(" · ")),
    s("svg", { viewBox: `0 0 ${W} 24`, preserveAspectRatio: "none", class: "mem-bar", role: "img",
      "aria-label": words[0] },
      s("rect", { x: 0, y: 0, width: W, height: 24, class: "mem-free" }), ...rects, ...marks),
    h("p", { class: "muted legend" }, known.length
      ? known.map((r) => `${r.model} ${gib(r.mib)}${r.measured ? "" : " (declared)"}`).join(" · ")
      : "No model with a known footprint is loaded."));
}

const POLL_MS = 2000;

export async function render(main, info) {
  const body = h("section", { id: "models" });
  main.append(h("h1", {}, "Models"), body);

  const unload = async (m) => {
    const id = m.id;
    // The server stops a busy model too: say what that does before it happens.
    const busy = m.in_flight
      ? ` ${m.in_flight} request${m.in_flight === 1 ? " is" : "s are"} running on it: ` +
        "a job goes back in the queue, a synchronous request fails."
      : "";
    if (!confirmed(`Unload ${id}? Its server process is stopped.${busy}`)) return;
    try {
      const done = await api("/api/models/unload/" + encodeURIComponent(id), { method: "POST" });
      flash(done.unloaded.length ? `Unloading ${done.unloaded.join(", ")}.` : `${id} was not unloaded: it is busy or not loaded.`, !done.unloaded.length);
    } catch (error) {
      flash(`Not unloaded: ${error.message}`, true);
    }
    refresh();
  };
  const load = async (m) => {
    if (!confirmed(`Load ${m.id}? The load queues like any request and may swap out the loaded model.`)) return;
    flash(`Loading ${m.id}…`);
    try {
      // Through the proxy, as llama-swap's UI does: the scheduler queues it and records it.
      await api("/upstream/" + encodeURIComponent(m.id) + m.check_endpoint);
      flash(`${m.id} is loaded.`);
    } catch (error) {
      flash(`Not loaded: ${error.message}`, true);
    }
    refresh();
  };

  let timer = null;
  async function refresh() {
    clearTimeout(timer);
    try {
      const data = await api("/ui/api/models");
      const rows = data.models.map((m) => h("tr", { "data-model": m.id },
        h("td", {}, m.id, m.name ? h("span", { class: "muted" }, " " + m.name) : null),
        h("td", { class: "aliases" }, m.aliases && m.aliases.length ? m.aliases.join(", ") : "–"),
        h("td", {}, m.upstream ?? "–", m.port ? h("span", { class: "muted" }, ` (port ${m.port})`) : null),
        h("td", {}, h("span", { class: "state state-" + (m.state || "unknown") }, m.state || "–")),
        h("td", { class: "num" }, m.pid ?? "–"),
        h("td", { class: "num" }, m.in_flight ?? "–"),
        h("td", { class: "num" }, m.waiting ?? "–"),
        h("td", { class: "num" }, duration(m.median_load_s)),
        h("td", { class: "num" }, duration(m.median_run_s)),
        h("td", { class: "num", title: m.gpu_memory_mib && !m.gpu_memory_measured ? "declared (gpuMemory)" : null },
          gib(m.gpu_memory_mib), m.gpu_memory_mib && !m.gpu_memory_measured ? h("span", { class: "muted" }, " (declared)") : null),
        h("td", {}, data.live ? [
          h("button", { onclick: () => load(m), disabled: m.state !== "stopped" }, "Load"), " ",
          h("button", {
            class: "danger", onclick: () => unload(m), disabled: m.state !== "ready" && m.state !== "sleeping",
            title: m.in_flight ? `busy: ${m.in_flight} running` : null,
          }, m.in_flight ? "Unload (busy)…" : "Unload"),
        ] : null),
      ));
      // An admin sees each model's last lines (none yet: it says so); others see none.
      const outputs = data.models.filter((m) => m.output).map((m) =>
        h("details", { open: m.output.length > 0, "data-output": m.id },
          h("summary", {}, `Recent output of ${m.id} (last ${m.output.length} lines)`),
          m.output.length ? h("pre", { class: "output" }, m.output.join("\n")) : h("p", { class: "muted" }, "Nothing printed since the server started.")));
      body.replaceChildren(
        memoryBar(data.memory) ?? "",
        table(["model", "aliases", "upstream", "state", "pid", "running", "waiting", "median load", "median run", "GPU memory", ""], rows),
        data.live ? "" : h("p", { class: "muted" }, "Read-only: models seen in the log, with their median load time."),
        ...outputs,
      );
    } catch (error) {
      flash(`Models not updated: ${error.message}`, true);
    }
    if (info.live) timer = setTimeout(refresh, POLL_MS);
  }
  await refresh();
}
