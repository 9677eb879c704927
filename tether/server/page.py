"""The cluster page: static HTML that polls ``api/cluster?brief=1`` (one request per refresh)
and draws it: a grid of nodes, each cell its worst rank's state, the node holding the job back
first; below, the ranks of the node opened (the first, until another is clicked). Every value is
put in with ``textContent``, never parsed as HTML, and the Content-Security-Policy admits only
this page's own script and style: a host or op name cannot inject anything.

It is kept as a string, not a package data file, so it ships with the code however tether is
installed.
"""

from __future__ import annotations

import base64
import hashlib
from http import HTTPStatus

from tether.server.web import Response

__all__ = ["page_response"]

_STYLE = """
:root { --fg: #1d2433; --muted: #5f6b7a; --line: #dde2ea; --bad: #b42318; --bad-bg: #fdeceb;
  --ok: #067647; --ok-bg: #e7f6ec; --warn: #a15c07; --warn-bg: #fdf3e1; --link: #1f57c3; }
* { box-sizing: border-box; }
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg);
  margin: 0; background: #f6f7f9; }
main { max-width: 1280px; margin: 0 auto; padding: 24px 28px 40px; }
header { display: flex; align-items: baseline; gap: 16px; flex-wrap: wrap; }
h1 { font-size: 22px; margin: 0; }
h2 { font-size: 17px; margin: 28px 0 10px; }
.meta { color: var(--muted); }
.summary { margin: 18px 0; padding: 14px 18px; border-radius: 8px; font-size: 16px;
  border: 1px solid var(--line); background: #fff; }
.summary.bad { border-color: #f3b5ae; background: var(--bad-bg); }
.summary.ok { border-color: #a6dcb8; background: var(--ok-bg); }
.summary strong { display: block; margin-bottom: 2px; }
table { border-collapse: collapse; width: 100%; background: #fff; border: 1px solid var(--line);
  border-radius: 8px; overflow: hidden; }
th, td { text-align: left; padding: 9px 12px; border-bottom: 1px solid var(--line);
  vertical-align: top; }
th { font-size: 13px; font-weight: 600; color: var(--muted); background: #fafbfc;
  white-space: nowrap; }
tr:last-child td { border-bottom: none; }
tr.holding-back td { background: var(--bad-bg); }
tr.holding-back td:first-child { box-shadow: inset 4px 0 0 var(--bad); }
td.rank { font-weight: 700; font-size: 16px; white-space: nowrap; }
.num { font-variant-numeric: tabular-nums; white-space: nowrap; }
.op { font-family: ui-monospace, "SF Mono", Menlo, Consolas, monospace; font-size: 13.5px;
  white-space: nowrap; }
.path { font-family: ui-monospace, "SF Mono", Menlo, Consolas, monospace; font-size: 13px;
  color: var(--muted); word-break: break-all; }
.sub { color: var(--muted); font-size: 13px; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 999px; font-size: 12.5px;
  font-weight: 600; white-space: nowrap; }
.badge.ok { color: var(--ok); background: var(--ok-bg); }
.badge.bad { color: #fff; background: var(--bad); }
.badge.warn { color: var(--warn); background: var(--warn-bg); }
.badge.off { color: var(--muted); background: #eceff3; }
a { color: var(--link); text-decoration: none; }
a:hover { text-decoration: underline; }
.links { white-space: nowrap; }
.links a { margin-right: 10px; }
.empty { color: var(--muted); padding: 12px 0; }
button { font: inherit; padding: 6px 14px; border-radius: 6px; border: 1px solid #b9c1cd;
  background: #fff; cursor: pointer; }
button:hover { background: #f0f2f5; }
.toolbar { display: flex; gap: 12px; align-items: center; margin-top: 14px; }
.toolbar a:first-of-type { margin-left: auto; }
#error { color: var(--bad); }
.nodes { display: grid; grid-template-columns: repeat(auto-fill, minmax(132px, 1fr)); gap: 6px;
  margin: 0 0 18px; }
.node { font: inherit; text-align: left; padding: 6px 9px; border-radius: 6px; cursor: pointer;
  border: 1px solid var(--line); border-left: 5px solid #c3cad4; background: #fff; }
.node:hover { background: #f0f2f5; }
.node.ok { border-left-color: var(--ok); }
.node.warn { border-left-color: #e09a2b; background: var(--warn-bg); }
.node.bad { border-left-color: var(--bad); background: var(--bad-bg); }
.node.off { border-left-color: #8a94a3; background: #eceff3; }
.node[aria-pressed="true"] { outline: 2px solid var(--link); outline-offset: 1px; }
.node .op { display: block; overflow: hidden; text-overflow: ellipsis; }
.node .sub { display: block; }
"""

_SCRIPT = """
"use strict";
const token = new URLSearchParams(location.search).get("token");
const auth = token ? {Authorization: "Bearer " + token} : {};
const withToken = url => token ? url + (url.includes("?") ? "&" : "?") + "token=" +
  encodeURIComponent(token) : url;

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (key === "text") node.textContent = value;
    else if (key === "class") node.className = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) if (child != null) node.append(child);
  return node;
}

function age(seconds) {
  if (seconds == null) return "";
  if (seconds < 60) return seconds.toFixed(1) + " s";
  const m = Math.floor(seconds / 60);
  return m + " min " + Math.round(seconds - 60 * m) + " s";
}

// The server decides the word (row.state), so the badge and /api/cluster always agree.
// Worst first, as the server orders a node's states.
const BADGES = {"holding back": "bad", "no answer": "off", "hung": "warn", "healthy": "ok"};

function state(row) {
  return el("span", {class: "badge " + (BADGES[row.state] || "off"), text: row.state});
}

function rankRow(row) {
  const tr = el("tr", {"data-rank": row.rank, "data-holding-back": String(row.holding_back)});
  if (row.holding_back) tr.className = "holding-back";
  const first = el("td", {class: "rank", text: String(row.rank)});
  const status = el("td", {}, state(row));
  if (row.holding_back) {
    if (row.state !== "holding back")  // a rank that does not answer
      status.append(" ", el("span", {class: "badge bad", text: "holding back"}));
    tr.title = row.reason;  // spelled out in the summary above the table
  }
  if (!row.answered) status.append(el("div", {class: "sub", text: row.error || ""}));
  const where = el("td", {}, row.answered ? el("span", {class: "op", text: row.host}) : "",
    row.answered ? el("span", {class: "sub", text: " · pid " + row.pid}) : null);
  const op = row.oldest_in_flight;
  const inflight = el("td", {}, op ? el("div", {class: "op", text: op.op + " #" +
    op.collective_seq_id}) : el("span", {class: "sub", text: row.answered ? "nothing" : ""}),
    op ? el("div", {class: "sub", text: "group " + op.group_label +
      (row.in_flight > 1 ? " · " + row.in_flight + " in flight" : "")}) : null);
  const waited = el("td", {class: "num", text: op ? age(op.age_s) : ""});
  const done = el("td", {});
  for (const g of row.last_completed || [])
    done.append(el("div", {}, el("span", {class: "op", text: "#" + g.seq}), " ",
      el("span", {class: "sub", text: g.group_label})));
  const links = el("td", {class: "links"});
  if (row.url) for (const [label, path] of [["stacks", "/stacks?format=text"],
      ["trace", "/trace"], ["health", "/health"], ["metrics", "/metrics"]])
    links.append(el("a", {href: withToken(row.url + path), text: label}));
  tr.append(first, status, inflight, waited, done, where, links);
  return tr;
}

// The most lines of the summary: a dead node's ranks are one line, but 1,000 reasons are not read.
const LINES = 20;

function span(ranks) {  // [0, 1, 2, 5] -> "0-2, 5"
  const runs = [];
  for (const r of ranks) {
    const last = runs[runs.length - 1];
    if (last && r === last[1] + 1) last[1] = r; else runs.push([r, r]);
  }
  return runs.map(([a, b]) => b > a ? a + "-" + b : String(a)).join(", ");
}

function summary(data) {
  const box = document.getElementById("summary");
  box.replaceChildren();
  const held = data.holding_back;
  if (held.length) {
    box.className = "summary bad";
    box.append(el("strong", {text: (held.length > 1 ? "Ranks " : "Rank ") +
      span(held.map(h => h.rank)) + " holding the job back"}));
    const lines = new Map();  // the ranks of one host held back for one reason: one line
    for (const h of held) {
      const host = data.ranks[h.rank].host || "host unknown";
      const key = JSON.stringify([host, h.reason]);
      if (!lines.has(key)) lines.set(key, {host: host, reason: h.reason, ranks: []});
      lines.get(key).ranks.push(h.rank);
    }
    for (const line of [...lines.values()].slice(0, LINES))
      box.append(el("div", {text: (line.ranks.length > 1 ? "ranks " : "rank ") +
        span(line.ranks) + " (" + line.host + "): " + line.reason}));
    if (lines.size > LINES)
      box.append(el("div", {class: "sub", text: "and " + (lines.size - LINES) + " more: " +
        "the nodes below, and api/cluster, say them all"}));
  } else {
    box.className = "summary ok";
    box.append(el("strong", {text: "No rank is holding the job back"}));
  }
}

function events(data) {
  const body = document.getElementById("events");
  body.replaceChildren();
  for (const e of data.events.slice().reverse()) {
    const done = Object.keys(e.done).length;
    body.append(el("tr", {},
      el("td", {}, el("a", {class: "op", href: withToken("api/events?id=" +
        encodeURIComponent(e.event_id)), text: e.event_id})),
      el("td", {text: e.reason}),
      el("td", {}, e.origin, e.detail ? el("div", {class: "sub", text: e.detail}) : null),
      el("td", {class: "num", text: done + " / " + data.world_size}),
      el("td", {class: "path", text: e.dir})));
  }
  body.closest("table").hidden = data.events.length === 0;
  document.getElementById("no-events").hidden = data.events.length > 0;
}

let shown = null;  // the last answer, drawn again when another node is opened
let opened;  // the host of the node whose ranks are listed; undefined: the first node

function nodeCell(node) {
  const counts = Object.keys(BADGES).filter(s => node.states[s]).map(s => node.states[s] + " " +
    s).join(" · ");  // worst first
  const cell = el("button", {type: "button", class: "node " + (BADGES[node.state] || "off"),
    "data-host": node.host || "", "data-state": node.state,
    "aria-pressed": String(node.host === opened)},
    el("span", {class: "op", text: node.host || "host unknown"}),
    el("span", {class: "sub", text: counts}));
  cell.title = (node.ranks.length > 1 ? "ranks " : "rank ") + span(node.ranks);
  cell.addEventListener("click", () => { opened = node.host; draw(); });
  return cell;
}

function draw() {
  const data = shown;
  if (!data.nodes.some(n => n.host === opened)) opened = data.nodes.length ? data.nodes[0].host
    : undefined;
  document.getElementById("nodes").replaceChildren(...data.nodes.map(nodeCell));
  const node = data.nodes.find(n => n.host === opened);
  document.getElementById("node-title").textContent = node ? "Ranks on " +
    (node.host || "an unknown host") + " (" + node.ranks.length + ")" : "Ranks";
  document.getElementById("ranks").replaceChildren(
    ...(node ? node.ranks.map(r => rankRow(data.ranks[r])) : []));
}

function render(data) {
  document.getElementById("job").textContent = (data.job_id ? "job " + data.job_id + " · " : "") +
    data.world_size + " ranks on " + data.nodes.length + (data.nodes.length > 1 ? " nodes" :
    " node") + " · updated " + new Date(data.time_ns / 1e6).toLocaleTimeString();
  summary(data);
  shown = data;
  draw();
  events(data);
  document.getElementById("error").textContent = "";
  if (!document.documentElement.dataset.firstDrawnMs)  // how long the page took to show the job
    document.documentElement.dataset.firstDrawnMs = String(Math.round(performance.now()));
}

async function refresh() {
  try {
    const response = await fetch("api/cluster?brief=1", {headers: auth, cache: "no-store"});
    if (!response.ok) throw new Error((await response.json()).error || "HTTP " + response.status);
    render(await response.json());
  } catch (err) {
    document.getElementById("error").textContent = "could not refresh: " + err.message;
  } finally {
    setTimeout(refresh, 2000);
  }
}

document.getElementById("dump").addEventListener("click", async () => {
  const out = document.getElementById("dump-result");
  try {
    const response = await fetch("dump", {method: "POST", headers: auth});
    const body = await response.json();
    out.textContent = response.ok ? "every rank dumps into " + body.dir : body.error;
  } catch (err) {
    out.textContent = "dump failed: " + err.message;
  }
});
document.getElementById("json").href = withToken("api/cluster");
document.getElementById("job-metrics").href = withToken("metrics/job");
refresh();
"""

_HTML = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>tether · cluster</title>
<style>{style}</style>
</head>
<body>
<main>
<header><h1>tether · cluster</h1><span class="meta" id="job">loading…</span>
<span class="meta" id="error"></span></header>
<div class="summary" id="summary">Asking every rank…</div>
<div class="nodes" id="nodes"></div>
<h2 id="node-title">Ranks</h2>
<table>
<thead><tr><th>Rank</th><th>State</th><th>Oldest in flight</th><th>Waiting</th>
<th>Last completed</th><th>Host</th><th>Details</th></tr></thead>
<tbody id="ranks"></tbody>
</table>
<h2>Dump events</h2>
<table>
<thead><tr><th>Event</th><th>Reason</th><th>Raised by</th><th>Ranks done</th><th>Directory</th>
</tr></thead>
<tbody id="events"></tbody>
</table>
<div class="empty" id="no-events">No dump events yet.</div>
<div class="toolbar"><button id="dump" type="button">Dump every rank now</button>
<span id="dump-result" class="meta"></span>
<a id="json" href="api/cluster">this page as JSON</a>
<a id="job-metrics" href="metrics/job">every rank's metrics</a></div>
</main>
<script>{script}</script>
</body>
</html>
"""


def _hash(source: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(source.encode()).digest()).decode() + "'"


_BODY = _HTML.format(style=_STYLE, script=_SCRIPT).encode()
_CSP = (
    f"default-src 'none'; script-src {_hash(_SCRIPT)}; style-src {_hash(_STYLE)}; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)


def page_response() -> Response:
    return Response(
        HTTPStatus.OK, _BODY, "text/html; charset=utf-8", {"Content-Security-Policy": _CSP}
    )
