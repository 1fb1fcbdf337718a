// Chain page: a caller's run of requests sent one at a time (X-Gpulane-Chain),
// its progress as a batch's (progress.js), then its shots, each linked to its
// request's story. `?caller=` names whose chain, for an admin, when two callers
// use the same id.
import { api } from "./api.js";
import { h, stamp, storyLink, table } from "./dom.js";
import { progressSection } from "./progress.js";

const PAGE = 200;

export async function render(main, info, id) {
  main.append(h("h1", {}, "Chain ", h("code", { id: "chain-id" }, id)));
  if (!info.live) {
    main.append(h("p", {}, "This is a copy of a log (gpulane ui --db): chains are shown by a live server; each shot's story names its chain."));
    return;
  }
  const body = h("div", {});
  main.append(body);
  await draw(body, id, 0);
}

async function draw(body, id, offset) {
  const caller = new URLSearchParams(location.search).get("caller");
  const query = `?offset=${offset}&limit=${PAGE}` + (caller ? `&caller=${encodeURIComponent(caller)}` : "");
  let chain;
  try {
    chain = await api("/api/chains/" + encodeURIComponent(id) + query);
  } catch (error) {
    body.replaceChildren(h("p", { class: "error" }, error.message));
    return;
  }
  const facts = [
    ["status", h("span", { class: "status status-" + chain.status, id: "chain-status" }, chain.status)],
    ["caller", chain.caller || "anonymous"],
    ["model", chain.model],
    ["length", chain.length === null ? "not given (X-Gpulane-Chain-Length)" : chain.length],
    ["sent", chain.sent],
    ["first shot", stamp(chain.first_at)],
    ["latest shot", stamp(chain.last_at)],
  ];
  const rows = chain.shots.map((s) => h("tr", {},
    h("td", { class: "num" }, s.shot),
    h("td", {}, storyLink(s.request_id)),
    h("td", {}, h("span", { class: "status status-" + s.status }, s.status)),
    h("td", { class: "num" }, s.http_status || "–")));
  const shown = `Shots ${offset + 1}–${offset + chain.shots.length} of ${chain.sent}`;
  body.replaceChildren(
    h("dl", { class: "facts" }, facts.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])),
    progressSection(chain.progress, { prefix: "chain", unit: "shots" }),
    h("section", { id: "chain-shots" },
      h("h2", {}, chain.shots.length ? shown : "Shots"),
      table(["shot", "request", "status", "HTTP"], rows),
      h("p", {},
        offset > 0 ? h("button", { onclick: () => draw(body, id, Math.max(0, offset - PAGE)) }, "Previous") : null,
        offset + chain.shots.length < chain.sent ? h("button", { onclick: () => draw(body, id, offset + PAGE) }, "Next") : null)),
  );
}
