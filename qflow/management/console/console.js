// qflowd's web console: renders the snapshots of GET /api/events (server-sent events) and calls the
// management API's own routes for its actions. No library, no network beyond this broker; every name
// shown is set as text (a queue name is chosen by clients, never trusted as HTML).
"use strict";

const HISTORY_SECONDS = 120;   // the most a chart spans
const MIN_SPAN_SECONDS = 30;   // the least: a page just opened charts its first seconds on this span
const CHART_ALL_UP_TO = 12;    // chart every queue while there are at most this many
const SVG = "http://www.w3.org/2000/svg";

const history = new Map();     // queue name -> [{t, depth, bytes, stopped, stop, resume, stopSize, resumeSize}]
const pinned = new Set();      // queues charted because their name was clicked
const rows = new Map();        // queue name -> its <tr>
let queues = new Map();        // queue name -> its latest view
let editing = null;            // the queue whose thresholds form is open

function $(id) { return document.getElementById(id); }

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === "dataset") Object.assign(node.dataset, v);
    else if (k === "className") node.className = v;
    else if (k === "onclick") node.addEventListener("click", v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

function rate(v) { return v === null || v === undefined ? "–" : String(v); }

function pair(a, b) { return a ? `${a} / ${b}` : (b ? `– / ${b}` : "–"); }

function clock(iso) { return iso ? iso.slice(11, 19) : ""; }

function apiPath(name) { return "/api/queues/" + encodeURIComponent(name); }

function say(text, kind = "info") {
  const m = $("message");
  m.textContent = text;
  m.dataset.kind = kind;
  m.hidden = false;
}

// -- actions: the management API's routes, as the tools call them ---------------------------------
// {status, answer} of a request, or null once a failure or refusal is shown with the API's own words.
async function send(method, path, body) {
  const init = {method, headers: {"Content-Type": "application/json"}};
  if (body !== undefined) init.body = JSON.stringify(body);
  let response;
  try {
    response = await fetch(path, init);
  } catch (e) {
    say(`${method} ${path}: ${e}`, "error");
    return null;
  }
  let answer = null;
  try { answer = await response.json(); } catch (e) { /* no JSON body */ }
  if (!response.ok) {
    say(`${method} ${decodeURIComponent(path)}: ${response.status} ${answer && answer.error ? answer.error : ""}`, "error");
    return null;
  }
  return {status: response.status, answer};
}

async function call(method, path, body) {
  const sent = await send(method, path, body);
  return sent ? sent.answer : null;
}

async function purge(name) {
  const q = queues.get(name);
  if (!confirm(`Purge queue "${name}"? Its ${q ? q.msgDepth : ""} messages are removed for good.`)) return;
  const answer = await call("POST", apiPath(name) + "/purge");
  if (answer) say(`Purged ${answer.purged} messages from "${name}".`);
}

async function remove(name) {
  if (!confirm(`Delete queue "${name}" and every message on it?`)) return;
  const answer = await call("DELETE", apiPath(name));
  if (answer) say(`Deleted queue "${name}" (${answer.messages} messages).`);
}

async function closeConnection(peer, label) {
  if (!confirm(`Close the connection ${label}? Its client is told it was closed by an operator; ` +
               "messages it was delivered and had not accepted go back to their queues.")) return;
  const answer = await call("DELETE", "/api/connections/" + encodeURIComponent(peer));
  if (answer) say(`Closed the connection ${label}.`);
}

function editThresholds(name) {
  const q = queues.get(name);
  if (!q) return;
  editing = name;
  const form = $("thresholds");
  $("thresholds-queue").textContent = name;
  form.elements["qpid.flow_stop_count"].value = q.flowStopCount;
  form.elements["qpid.flow_resume_count"].value = q.flowResumeCount;
  form.elements["qpid.flow_stop_size"].value = q.flowStopSize;
  form.elements["qpid.flow_resume_size"].value = q.flowResumeSize;
  form.hidden = false;
  form.elements["qpid.flow_stop_count"].focus();
}

async function applyThresholds(event) {
  event.preventDefault();
  const name = editing;
  const q = queues.get(name);
  if (!q) return;
  const current = {"qpid.flow_stop_count": q.flowStopCount, "qpid.flow_resume_count": q.flowResumeCount,
                   "qpid.flow_stop_size": q.flowStopSize, "qpid.flow_resume_size": q.flowResumeSize};
  const args = {};
  for (const [key, value] of Object.entries(current)) {   // only what was changed: the rest keeps its source
    const text = $("thresholds").elements[key].value.trim();
    if (text !== "" && Number(text) !== value) args[key] = Number(text);
  }
  if (Object.keys(args).length === 0) { say("No threshold changed."); return; }
  const answer = await call("PATCH", apiPath(name), {arguments: args});
  if (answer) {
    say(`Thresholds of "${name}": stop ${pair(answer.flowStopCount, answer.flowResumeCount)} messages, ` +
        `${pair(answer.flowStopSize, answer.flowResumeSize)} bytes.`);
    $("thresholds").hidden = true;
    editing = null;
  }
}

// The arguments textarea: one KEY=VALUE a line, blank lines skipped. A whole number is sent as a
// number, as qflow-config's --argument does (the broker wants integers for its limits); anything
// else as a string. Throws an Error naming the line it cannot read.
function parseArguments(text) {
  const args = {};
  text.split("\n").forEach((raw, i) => {
    const line = raw.trim();
    if (line === "") return;
    const at = line.indexOf("=");
    if (at <= 0) throw new Error(`arguments, line ${i + 1}: expected KEY=VALUE, got "${line}"`);
    const key = line.slice(0, at).trim(), value = line.slice(at + 1).trim();
    if (/^-?\d+$/.test(value)) {
      if (!Number.isSafeInteger(Number(value))) {
        throw new Error(`arguments, line ${i + 1}: ${key}: ${value} is beyond the integers a browser sends exactly ` +
                        `(±${Number.MAX_SAFE_INTEGER}); use qflow-config`);
      }
      args[key] = Number(value);
    } else {
      args[key] = value;
    }
  });
  return args;
}

async function createQueue(event) {
  event.preventDefault();
  const form = $("new-queue");
  const name = form.elements["name"].value;
  if (name === "") { say("New queue: give it a name.", "error"); return; }
  let args;
  try { args = parseArguments(form.elements["arguments"].value); } catch (e) { say(`New queue: ${e.message}`, "error"); return; }
  const durable = form.elements["durable"].checked;
  const sent = await send("PUT", apiPath(name), {durable, arguments: args});
  if (!sent) return;
  say(sent.status === 201 ? `Created ${durable ? "durable " : ""}queue "${name}".`
                          : `Queue "${name}" exists already, with these settings.`);
  form.reset();
}

async function createBinding(event) {
  event.preventDefault();
  const form = $("new-binding");
  const [exchange, queue, key] = ["exchange", "queue", "key"].map(f => form.elements[f].value);
  const sent = await send("POST", "/api/bindings", {exchange, queue, key});
  if (!sent) return;
  const what = `queue "${queue}" to exchange "${exchange}" with key "${key}"`;
  say(sent.status === 201 ? `Bound ${what}.` : `Already bound: ${what}.`);
}

// -- the queues table -----------------------------------------------------------------------------
const COLUMNS = ["msgDepth", "byteDepth", "countThresholds", "sizeThresholds", "flowStopped", "flowStoppedCount",
                 "held", "enqueueRate", "dequeueRate"];

function queueRow(name) {
  const tr = el("tr", {dataset: {queue: name}});
  const label = el("td", {className: "name", title: "chart this queue"}, name);
  label.addEventListener("click", () => { pinned.has(name) ? pinned.delete(name) : pinned.add(name); drawCharts(); });
  tr.append(label);
  for (const c of COLUMNS) tr.append(el("td", {className: c}));
  tr.append(el("td", {className: "actions"},
    el("button", {type: "button", className: "purge", onclick: () => purge(name)}, "Purge"),
    el("button", {type: "button", className: "edit", onclick: () => editThresholds(name)}, "Thresholds"),
    el("button", {type: "button", className: "delete", onclick: () => remove(name)}, "Delete")));
  return tr;
}

function renderQueues(list) {
  const body = document.querySelector("#queues tbody");
  const seen = new Set();
  for (const q of list) {
    seen.add(q.name);
    let tr = rows.get(q.name);
    if (!tr) { tr = queueRow(q.name); rows.set(q.name, tr); }
    body.append(tr);   // appending moves it: rows stay in the snapshot's (name) order
    const cell = c => tr.querySelector("td." + c);
    cell("msgDepth").textContent = String(q.msgDepth);
    cell("byteDepth").textContent = String(q.byteDepth);
    cell("countThresholds").textContent = pair(q.flowStopCount, q.flowResumeCount);
    cell("sizeThresholds").textContent = pair(q.flowStopSize, q.flowResumeSize);
    cell("flowStopped").textContent = q.flowStopped ? "Y" : "N";
    cell("flowStopped").dataset.stopped = String(q.flowStopped);
    cell("flowStoppedCount").textContent = String(q.flowStoppedCount);
    cell("held").textContent = String(q.heldSessionCount);
    cell("held").title = `${q.heldTransfers} transfers held`;
    cell("enqueueRate").textContent = rate(q.enqueueRate);
    cell("dequeueRate").textContent = rate(q.dequeueRate);
    tr.classList.toggle("stopped", q.flowStopped);
  }
  for (const [name, tr] of rows) {
    if (!seen.has(name)) { tr.remove(); rows.delete(name); history.delete(name); pinned.delete(name); }
  }
  $("no-queues").hidden = list.length > 0;
  if (editing !== null && !seen.has(editing)) { $("thresholds").hidden = true; editing = null; }
}

// -- the charts: depth against the stop and resume thresholds, flow-stopped periods shaded ----------
function record(list, now) {
  for (const q of list) {
    let h = history.get(q.name);
    if (!h) { h = []; history.set(q.name, h); }
    h.push({t: now, depth: q.msgDepth, bytes: q.byteDepth, stopped: q.flowStopped,
            stop: q.flowStopCount, resume: q.flowResumeCount, stopSize: q.flowStopSize, resumeSize: q.flowResumeSize});
    while (h.length && h[0].t < now - HISTORY_SECONDS * 1000) h.shift();
  }
}

function chart(name, h, now) {
  // Messages when the queue has a stop count, else bytes when it has a stop size, else messages.
  const last = h[h.length - 1];
  const bytes = !last.stop && last.stopSize > 0;
  const unit = bytes ? "bytes" : "messages";
  const value = s => bytes ? s.bytes : s.depth;
  const stop = bytes ? last.stopSize : last.stop;
  const resume = bytes ? last.resumeSize : last.resume;
  const W = 420, H = 170, L = 56, R = 8, T = 10, B = 22;
  const top = Math.max(1, stop * 1.15, ...h.map(value)) * 1.05;
  const span = Math.min(HISTORY_SECONDS, Math.max(MIN_SPAN_SECONDS, (now - h[0].t) / 1000)) * 1000;
  const x = t => L + (W - L - R) * (1 - (now - t) / span);
  const y = v => T + (H - T - B) * (1 - v / top);
  const root = svg("svg", {viewBox: `0 0 ${W} ${H}`, role: "img",
                           "aria-label": `${name}: depth in ${unit} against its thresholds`});
  // Shaded: each run of snapshots with flowStopped, from its first to the next one that is not.
  let start = null;
  h.forEach((s, i) => {
    if (s.stopped && start === null) start = s.t;
    const end = !s.stopped ? s.t : (i === h.length - 1 ? now : null);
    if (start !== null && end !== null) {
      root.append(svg("rect", {class: "stopped", x: x(start), y: T, width: Math.max(1, x(end) - x(start)),
                               height: H - T - B, "data-from": new Date(start).toISOString()}));
      start = null;
    }
  });
  root.append(svg("line", {class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B}));
  root.append(svg("line", {class: "axis", x1: L, y1: T, x2: L, y2: H - B}));
  const label = (text, ty) => { const t = svg("text", {x: L - 4, y: ty + 4, "text-anchor": "end"}); t.textContent = text; root.append(t); };
  label("0", H - B);
  label(String(Math.round(top)), T + 6);
  for (const [cls, v, text] of [["stop-line", stop, "stop"], ["resume-line", resume, "resume"]]) {
    if (!v) continue;
    root.append(svg("line", {class: cls, x1: L, y1: y(v), x2: W - R, y2: y(v), "data-value": v}));
    const t = svg("text", {x: L + 4, y: y(v) - 3, class: cls + "-label"});
    t.textContent = `${text} ${v}`;
    root.append(t);
  }
  const points = h.map(s => `${x(s.t).toFixed(1)},${y(value(s)).toFixed(1)}`).join(" ");
  root.append(svg("polyline", {class: "depth", points}));
  const axis = svg("text", {x: W - R, y: H - 6, "text-anchor": "end"});
  axis.textContent = `${unit}, last ${Math.round(span / 1000)} s`;
  root.append(axis);
  return el("figure", {className: "chart", dataset: {queue: name}}, el("figcaption", {}, `${name}: ${value(last)} ${unit}`), root);
}

function drawCharts() {
  const now = Date.now();
  const box = $("charts");
  const all = history.size <= CHART_ALL_UP_TO;
  const figures = [];
  for (const [name, h] of [...history].sort((a, b) => a[0] < b[0] ? -1 : 1)) {
    const q = queues.get(name);
    if (h.length && (all || pinned.has(name) || (q && q.flowStopped))) figures.push(chart(name, h, now));
  }
  box.replaceChildren(...figures);
}

// -- connections and sessions ---------------------------------------------------------------------
function renderConnections(list) {
  const body = document.querySelector("#connections tbody");
  const out = [];
  for (const c of list) {
    const sessions = c.sessions.length ? c.sessions : [null];
    sessions.forEach((s, i) => {
      const heldBy = s ? s.heldBy.map(h => `${h.queue ?? h.holder} since ${clock(h.since)} (${h.heldSeconds} s)`).join(", ") : "";
      const tr = el("tr", {dataset: {connection: c.peer, session: s ? s.name : ""}},
        el("td", {}, i === 0 ? `${c.name || ""} ${c.peer}`.trim() : ""),
        el("td", {className: "protocol"}, i === 0 ? c.protocol || "" : ""),
        el("td", {}, i === 0 ? c.user || "" : ""),
        el("td", {}, i === 0 ? `${clock(c.connectedAt)} (${Math.round(c.connectedSeconds)} s)` : ""),
        el("td", {className: "session"}, s ? s.name || `channel ${s.channel}` : "–"),
        el("td", {}, s && s.senderCapacity !== null && s.senderCapacity !== undefined ? String(s.senderCapacity) : ""),
        el("td", {className: "heldTransfers"}, s ? String(s.heldTransfers) : ""),
        el("td", {className: "heldBy"}, heldBy || (s ? "–" : "")),
        el("td", {}, s ? String(s.unackedDeliveries) : ""),
        el("td", {className: "actions"}, i === 0 ? el("button", {type: "button", className: "close",
          onclick: () => closeConnection(c.peer, `${c.name || ""} ${c.peer}`.trim())}, "Close") : ""));
      if (s && s.flowStopped) tr.classList.add("stopped");
      out.push(tr);
    });
  }
  body.replaceChildren(...out);
  $("no-connections").hidden = list.length > 0;
}

// -- the feed ---------------------------------------------------------------------------------------
function render(snap) {
  const now = Date.now();
  queues = new Map(snap.queues.map(q => [q.name, q]));
  renderQueues(snap.queues);
  record(snap.queues, now);
  drawCharts();
  renderConnections(snap.connections);
  const b = snap.broker;
  $("broker").textContent = b ? `${b.name} ${b.version}, up ${Math.round(b.uptimeSeconds)} s, ` +
    `${b.totals.queues} queues, ${b.totals.connections} connections, ${b.totals.flowStoppedQueues} flow-stopped`
    : `user ${snap.user}`;
  document.body.dataset.updated = snap.time;
}

function setStatus(state, text) {
  const s = $("status");
  s.dataset.state = state;
  s.textContent = text;
}

function connect() {
  const source = new EventSource("/api/events");
  source.addEventListener("snapshot", e => { setStatus("live", "live"); render(JSON.parse(e.data)); });
  source.addEventListener("error", () => {
    if (source.readyState === EventSource.CLOSED) {
      // Refused (too many consoles open, credentials) or the broker is gone: try again a little later.
      setStatus("closed", "disconnected: retrying in 5 s");
      setTimeout(connect, 5000);
    } else {
      setStatus("connecting", "reconnecting…");
    }
  });
}

document.addEventListener("DOMContentLoaded", () => {
  $("thresholds").addEventListener("submit", applyThresholds);
  $("thresholds-cancel").addEventListener("click", () => { $("thresholds").hidden = true; editing = null; });
  $("new-queue").addEventListener("submit", createQueue);
  $("new-binding").addEventListener("submit", createBinding);
  connect();
});
