// The console's router: every page path serves the same shell; this picks the page.
import { api } from "./api.js";
import { h } from "./dom.js";

const ROUTES = [
  [/^\/ui\/$/, "queue"],
  [/^\/ui\/timeline$/, "timeline"],
  [/^\/ui\/models$/, "models"],
  [/^\/ui\/history$/, "history"],
  [/^\/ui\/requests\/([^/]+)$/, "story"],
  [/^\/ui\/batches$/, "batches"],
  [/^\/ui\/batches\/([^/]+)$/, "batch"],
  [/^\/ui\/chains$/, "chains"],
  [/^\/ui\/chains\/([^/]+)$/, "chain"],
];

async function start() {
  const main = document.getElementById("main");
  const path = location.pathname;
  let page = "queue";
  let arg = null;
  for (const [pattern, name] of ROUTES) {
    const match = pattern.exec(path);
    if (match) {
      page = name;
      arg = match[1] ? decodeURIComponent(match[1]) : null;
      break;
    }
  }
  for (const link of document.querySelectorAll("nav a")) {
    if (link.dataset.page === page) link.setAttribute("aria-current", "page");
  }
  const info = await api("/ui/api/info");
  document.getElementById("mode").textContent = info.live
    ? `live · v${info.version}` + (info.caller ? ` · ${info.caller}` : "")
    : `read-only · ${info.database}`;
  const module = await import(`./${page}.js`);
  main.replaceChildren();
  await module.render(main, info, arg);
}

start().catch((error) => {
  document.getElementById("main").replaceChildren(h("p", { class: "error" }, String(error.message || error)));
});
