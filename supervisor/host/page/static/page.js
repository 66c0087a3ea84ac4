// The operator's page: polls /page/api/overview and draws it. Everything that came from an
// engine, a worker or the hub is set as text (textContent), never as markup.
"use strict";

const API = "api/";
const POLL_MS = 2000;
const STALE_S = 60;
let csrf = null;
let timer = null;
let serverNow = null;  // the gateway's clock at the last poll: a plan's age is counted on it
const drawn = {};  // section -> the JSON it was last drawn from: unchanged, it is not redrawn

function changed(name, data) {
  const text = JSON.stringify(data);
  if (drawn[name] === text) return false;
  drawn[name] = text;
  return true;
}

function engineShape(engines) {
  // what the engines section shows, less what moves with every heartbeat or plan (updated in place)
  return engines.map((row) => ({ ...row, heartbeatAge: null,
    status: row.status ? { ...row.status, checkedAt: null,
      memory: row.status.memory ? { ...row.status.memory, plannedAt: null } : null } : null }));
}

function $(id) { return document.getElementById(id); }

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }

function size(bytes) {
  if (bytes === null || bytes === undefined) return "-";
  if (bytes >= 1024 ** 3) return (bytes / 1024 ** 3).toFixed(1) + " GiB";
  if (bytes >= 1024 ** 2) return (bytes / 1024 ** 2).toFixed(0) + " MiB";
  return bytes >= 1024 ? (bytes / 1024).toFixed(0) + " KiB" : Math.round(bytes) + " B";
}

function showProblem(text) {
  const p = $("problem");
  p.textContent = text || "";
  p.hidden = !text;
}

async function call(method, path, body) {
  const headers = { "Accept": "application/json" };
  if (method === "POST") {
    headers["Content-Type"] = "application/json";
    if (csrf) headers["X-CSRF-Token"] = csrf;
  }
  const answer = await fetch(API + path, {
    method, headers, credentials: "same-origin",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  let data = null;
  try { data = await answer.json(); } catch (e) { data = null; }
  if (answer.status === 401 && path !== "signin") { signedOut(); }
  if (!answer.ok) {
    const message = data && data.error ? data.error.message : answer.status + " " + answer.statusText;
    throw new Error(message);
  }
  return data;
}

function signedOut() {
  csrf = null;
  for (const name of Object.keys(drawn)) delete drawn[name];
  if (timer) { clearInterval(timer); timer = null; }
  $("main-view").hidden = true;
  $("signout").hidden = true;
  $("signin-view").hidden = false;
  $("updated").textContent = "";
}

function signedIn(token) {
  csrf = token;
  $("signin-view").hidden = true;
  $("signin-problem").hidden = true;
  $("main-view").hidden = false;
  $("signout").hidden = false;
  refresh();
  if (!timer) timer = setInterval(refresh, POLL_MS);
}

async function refresh() {
  try {
    const data = await call("GET", "overview");
    serverNow = data.now;
    showProblem("");
    if (changed("engines", engineShape(data.engines))) drawEngines(data.engines);
    drawAges(data.engines);
    if (changed("fleet", fleetShape(data.fleet))) drawFleet(data.fleet);
    drawHeard(data.fleet);
    if (changed("memory", data.memory)) drawMemory(data.memory);
    drawPlanAges();
    if (changed("keys", data.keys)) drawKeys(data.keys);
    if (changed("models", data.models)) drawModels(data.models);
    if (changed("traffic", data.traffic)) drawTraffic(data.traffic);
    $("updated").textContent = "updated " + data.now;
  } catch (error) {
    if (csrf) showProblem("cannot update: " + error.message);
  }
}

function field(list, name, value) {
  list.appendChild(el("dt", null, name));
  list.appendChild(el("dd", null, value === null || value === undefined || value === "" ? "-" : value));
}

function drawAges(engines) {
  for (const row of engines) {
    const item = document.querySelector('.engine[data-engine="' + CSS.escape(row.name) + '"]');
    if (!item || row.heartbeatAge === null) continue;
    const age = Math.round(row.heartbeatAge);
    const shown = item.querySelector(".age");
    if (shown) shown.textContent = age + " s ago";
    const stale = item.querySelector(".stale");
    if (stale) stale.textContent = "heartbeat " + age + " s old";
    if (stale) stale.hidden = row.heartbeatAge <= STALE_S;
  }
  for (const row of engines) {  // the engines section is not redrawn for a newer plan alone
    const item = document.querySelector('.engine[data-engine="' + CSS.escape(row.name) + '"]');
    const shown = item ? item.querySelector(".plan-age") : null;
    const plan = row.status ? row.status.memory : null;
    if (shown && plan) shown.dataset.at = plan.plannedAt;
  }
}

function ago(at) {
  // seconds from `at` to the gateway's now (both the gateway's clock, not the browser's)
  if (!serverNow || !at) return null;
  return Math.max(0, Math.round((Date.parse(serverNow) - Date.parse(at)) / 1000));
}

function planAge(at) {
  const span = el("span", "plan-age");
  span.dataset.at = at;
  span.textContent = "planned " + ago(at) + " s ago";
  return span;
}

function drawPlanAges() {
  for (const span of document.querySelectorAll(".plan-age")) {
    const age = ago(span.dataset.at);
    span.textContent = age === null ? "" : "planned " + age + " s ago";
  }
}

function holds(state) { return state === "starting" || state === "running" || state === "stopping"; }

function verdict(plan, outdatedBy) {
  // a plan with no need that fits has nothing to plan from (its start is not checked): no verdict;
  // a refusal planned before another engine changed may be lifted: the next look plans again
  if (!plan.fits) return outdatedBy ? "may not fit" : "cannot fit";
  return plan.need === null ? "not planned" : "fits";
}

function planLine(item, plan, button, outdatedBy) {
  // a stopped or failed engine's plan: its need and verdict, said before Start is pressed
  const line = el("p", "plan " + (plan.fits ? "plan-fits" : "plan-unfit"));
  const need = plan.need === null ? (plan.fits ? "not planned" : "could not be planned") : "a start needs " + size(plan.need);
  line.appendChild(el("span", "plan-need", need + (verdict(plan) === "fits" ? " · fits now" : "")));
  const refused = verdict(plan, outdatedBy) + ": " + (plan.message || "the plan refuses it");
  if (!plan.fits) line.appendChild(el("span", outdatedBy ? "may-not-fit" : "cannot-fit", refused));
  else if (plan.message) line.appendChild(el("span", "plan-message", plan.message));
  if (!plan.fits && outdatedBy) line.appendChild(el("span", "plan-outdated", "planned before " + outdatedBy + " changed"));
  line.appendChild(planAge(plan.plannedAt));
  item.appendChild(line);
  if (!plan.fits && !outdatedBy) {
    button.disabled = true;
    button.title = refused;
  }
}

// what desired.json says was last asked, by whom and when (an older host's names no one)
function asked(desired) {
  const by = desired.requestedBy || "";
  const who = by === "operator" ? "an operator"
    : by === "gateway" ? "the gateway"
    : by.startsWith("operator@") ? "the operator of machine " + by.slice("operator@".length)
    : "a host that did not say who";
  const when = desired.requestedAt ? " at " + desired.requestedAt : "";
  return desired.desired + " (generation " + desired.generation + "), by " + who + when;
}

function drawEngines(engines) {
  const box = $("engine-list");
  clear(box);
  if (!engines.length) { box.appendChild(el("p", "muted", "No engine has a worker here.")); return; }
  for (const row of engines) {
    const status = row.status;
    const item = el("div", "engine");
    item.dataset.engine = row.name;
    const title = el("h3");
    title.appendChild(el("span", "name", row.name));
    const state = status ? status.state : "unknown";
    title.appendChild(el("span", "state state-" + state, state));
    if (row.probe && row.probe.degraded) title.appendChild(el("span", "state state-degraded", "degraded"));
    const stale = el("span", "stale");
    stale.hidden = true;
    title.appendChild(stale);
    item.appendChild(title);
    const list = el("dl");
    if (status) {
      field(list, "since", status.since);
      field(list, "heartbeat", "");
      list.lastChild.className = "age";
      field(list, "url", status.url);
      const engine = status.engine;
      field(list, "build", engine ? [engine.engineVersion, engine.image].filter(Boolean).join(" · ") : null);
      field(list, "weights", engine ? [engine.model, engine.modelRevision].filter(Boolean).join(" @ ") : null);
      field(list, "models", (status.models || []).join(", "));
      field(list, "asked", row.desired ? asked(row.desired) : null);
      field(list, "probe", row.probe ? probed(row.probe.models) : null);
    }
    item.appendChild(list);
    if (status && status.message) item.appendChild(el("p", "message", status.message));
    const buttons = {};
    for (const desired of ["running", "stopped"]) {
      const button = el("button", "act-" + desired, desired === "running" ? "Start" : "Stop");
      button.type = "button";
      button.addEventListener("click", () => ask(row.name, desired));
      buttons[desired] = button;
    }
    if (status && status.memory && !holds(status.state)) planLine(item, status.memory, buttons.running, row.memoryOutdatedBy);
    item.appendChild(buttons.running);
    item.appendChild(buttons.stopped);
    box.appendChild(item);
  }
}

function probed(models) {
  // each probed model's mark: "alpha: failed (no answer within 30 s) at ..." or its first token
  return Object.keys(models).map((model) => {
    const mark = models[model];
    const said = mark.degraded ? "failed (" + mark.reason + ")"
      : "ok" + (mark.ttftS === null ? "" : ", first token in " + Math.round(mark.ttftS * 1000) + " ms");
    return model + ": " + said + " at " + mark.checkedAt;
  }).join("; ");
}

async function ask(name, desired) {
  try {
    await call("POST", "engines/" + encodeURIComponent(name), { desired });
    refresh();
  } catch (error) { showProblem(name + ": " + error.message); }
}

// the other machines of a fleet: each one's engines as it published them, all of it as text
function fleetShape(fleet) {
  // what the section shows, less the age of each heartbeat (updated in place)
  return fleet ? { ...fleet, machines: fleet.machines.map((m) => ({ ...m, heardAge: null })) } : null;
}

function drawFleet(fleet) {
  const section = $("fleet");
  section.hidden = !fleet;
  if (!fleet) return;
  const box = $("machine-list");
  clear(box);
  if (!fleet.available) {
    box.appendChild(el("p", "stale", "The fleet's catalog is not available: other machines are not shown."));
    return;
  }
  if (!fleet.machines.length) { box.appendChild(el("p", "muted", "No other machine is in the fleet's catalog.")); return; }
  for (const machine of fleet.machines) {
    const group = el("div", "machine" + (machine.stale ? " machine-stale" : ""));
    group.dataset.machine = machine.name;
    const title = el("h3");
    title.appendChild(el("span", "name", machine.name));
    if (machine.stale) title.appendChild(el("span", "stale", "stale"));
    title.appendChild(el("span", "heard muted"));
    group.appendChild(title);
    if (!machine.engines.length) group.appendChild(el("p", "muted", "No engine published."));
    for (const row of machine.engines) group.appendChild(peerEngine(machine, row));
    box.appendChild(group);
  }
}

function peerEngine(machine, row) {
  const item = el("div", "engine peer-engine");
  item.dataset.engine = row.name;
  const title = el("h4");
  title.appendChild(el("span", "name", row.name));
  title.appendChild(el("span", "state state-" + row.state, row.state));
  item.appendChild(title);
  const list = el("dl");
  field(list, "models", row.models.join(", "));
  field(list, "running", row.running + (row.slots === null ? "" : " of " + row.slots + " slots") + ", " + row.waiting + " waiting");
  field(list, "build", row.build);
  field(list, "weights", row.weights);
  field(list, "memory plan", row.fits === null ? null : row.fits ? "fits" : "cannot fit: " + row.plan);
  if (row.stoppedByOperator) field(list, "asked", "stopped by an operator");
  item.appendChild(list);
  for (const desired of ["running", "stopped"]) {
    const button = el("button", "act-" + desired, desired === "running" ? "Start" : "Stop");
    button.type = "button";
    button.disabled = machine.stale;
    if (machine.stale) button.title = "machine " + machine.name + " is stale: its gateway is not asked";
    button.addEventListener("click", () => askMachine(machine.name, row.name, desired));
    item.appendChild(button);
  }
  return item;
}

function drawHeard(fleet) {
  if (!fleet || !fleet.available) return;
  for (const machine of fleet.machines) {
    const group = document.querySelector('.machine[data-machine="' + CSS.escape(machine.name) + '"]');
    const heard = group ? group.querySelector(".heard") : null;
    if (heard) heard.textContent = "last heard " + Math.round(machine.heardAge) + " s ago";
  }
}

async function askMachine(machine, name, desired) {
  try {
    await call("POST", "machines/" + encodeURIComponent(machine) + "/engines/" + encodeURIComponent(name), { desired });
    refresh();
  } catch (error) { showProblem(machine + " / " + name + ": " + error.message); }
}

const RESERVES = [["os", "OS"], ["services", "services"], ["voice", "voice"], ["runtime", "runtime"]];
const LIMIT_SOURCES = {
  host: "the host's memory, MemTotal", gpu: "the GPUs' memory", fixed: "fixed in the machine settings",
  meminfo: "MemTotal from /proc/meminfo",
};

function drawMemory(memory) {
  const box = $("memory-body");
  clear(box);
  if (!memory.available) { box.appendChild(el("p", "muted", "not available")); return; }
  const data = memory.data;
  const source = LIMIT_SOURCES[data.limitSource] || data.limitSource;
  box.appendChild(el("p", "limit", "limit " + size(data.limit) + " (" + source + ")"));
  const from = el("p", "muted plan-source");
  if (data.plan) {
    from.appendChild(el("span", null, "limit and reserves from " + data.plan.engine + "'s memory plan, "));
    from.appendChild(planAge(data.plan.plannedAt));
  } else {
    from.textContent = "no plan yet: no worker has published its memory plan, so the reserves are not known";
  }
  box.appendChild(from);
  const reserves = data.reserves ? RESERVES.map(([key, name]) => [key, name, data.reserves[key]]) : [];
  const counted = reserves.reduce((n, r) => n + r[2], 0) + data.held.reduce((n, h) => n + h.bytes, 0);
  const scale = Math.max(data.limit, counted) || 1;  // over the limit: the bar shows all that counts
  const bar = el("div", "bar stacked");
  const legend = el("ul", "legend");
  const part = (cls, name, bytes) => {
    const seg = el("span", cls);
    seg.style.width = (100 * bytes / scale).toFixed(2) + "%";
    seg.title = name + " " + size(bytes);
    bar.appendChild(seg);
    const li = el("li", cls.split(" ")[0]);
    li.appendChild(el("span", "swatch " + cls));
    li.appendChild(el("span", null, name + ": " + size(bytes)));
    legend.appendChild(li);
  };
  for (const [key, name, bytes] of reserves) part("reserve res-" + key, "reserve, " + name, bytes);
  data.held.forEach((claim, i) => part("held seg-" + (i % 4), claim.name + " (held)", claim.bytes));
  if (data.free >= 0) part("free seg-free", data.reserves ? "free" : "not claimed", data.free);
  box.appendChild(bar);
  box.appendChild(legend);
  if (data.free < 0) box.appendChild(el("p", "over", "over the limit by " + size(-data.free) + ": the reserves and what is held add up to " + size(counted)));
  if (data.availableNow !== null) box.appendChild(el("p", "muted", "available now (MemAvailable): " + size(data.availableNow)));
  if (data.needs.length || data.unplanned.length) box.appendChild(el("h3", null, "What a start needs (engines that hold nothing)"));
  for (const need of data.needs) box.appendChild(needBar(need, data.limit));
  if (data.unplanned.length) box.appendChild(el("p", "muted unplanned", "no memory plan published yet: " + data.unplanned.join(", ")));
}

function needBar(need, limit) {
  // a stopped or failed engine's planned need against the same limit; it counts against nothing
  const item = el("div", "need " + (need.fits ? "need-fits" : "need-unfit"));
  const said = verdict(need, need.outdatedBy);
  item.dataset.engine = need.name;
  const title = el("p", "need-title");
  title.appendChild(el("span", "name", need.name));
  title.appendChild(el("span", "state state-" + need.state, need.state));
  title.appendChild(el("span", "verdict verdict-" + said.split(" ")[0], said));
  item.appendChild(title);
  if (need.need !== null) {  // no need known: no bar
    const bar = el("div", "bar need-bar");
    const seg = el("span", need.fits ? "seg-need" : "seg-unfit");
    seg.style.width = Math.min(100, 100 * need.need / (limit || 1)).toFixed(2) + "%";
    seg.title = need.name + " needs " + size(need.need);
    bar.appendChild(seg);
    item.appendChild(bar);
  }
  const figures = el("p", "figures");
  const over = need.need !== null && need.need > limit ? ", more than the limit" : "";
  figures.appendChild(el("span", null, (need.need === null ? (need.fits ? "not planned" : "could not be planned") : "needs " + size(need.need) + " of " + size(limit) + over) + " · "));
  figures.appendChild(planAge(need.plannedAt));
  item.appendChild(figures);
  if (need.message) item.appendChild(el("p", "message", need.message));
  return item;
}

function drawKeys(keys) {
  const rows = $("key-rows");
  clear(rows);
  if (keys.problem) showProblem(keys.problem);
  const use = keys.use && keys.use.available ? keys.use.data : null;
  for (const key of keys.keys) {
    const tr = el("tr");
    tr.dataset.key = key.id;
    tr.appendChild(el("td", "key-name", key.name));
    tr.appendChild(el("td", null, key.id));
    tr.appendChild(el("td", null, key.created));
    tr.appendChild(el("td", null, key.expires || "never"));
    tr.appendChild(el("td", "budget", key.exempt ? "exempt" : key.budget || "default"));
    const mine = use ? use[key.id] : null;
    tr.appendChild(el("td", "last-use", !mine || !mine.lastUseKnown ? "not available" : mine.lastUse || "not in 7 days"));
    tr.appendChild(el("td", "spent", spentText(mine)));
    const cell = el("td");
    const button = el("button", "revoke", "Revoke");
    button.type = "button";
    button.addEventListener("click", () => revoke(key.id));
    cell.appendChild(button);
    tr.appendChild(cell);
    rows.appendChild(tr);
  }
}

function spentText(mine) {
  if (!mine || mine.spentTokens === null) return "not available";
  const spent = mine.spentTokens + " tokens, " + mine.spentRequests + " requests";
  if (mine.exempt) return spent + " (exempt from the budget)";
  if (mine.budget === null) return spent + " (no budget)";
  return spent + " of " + mine.budget + " (" + Math.round(100 * mine.spentTokens / mine.budget) + "%)";
}

async function revoke(id) {
  try { await call("POST", "keys/" + encodeURIComponent(id) + "/revoke", {}); refresh(); }
  catch (error) { showProblem("revoke: " + error.message); }
}

function rate(bytes) { return bytes === null || bytes === undefined ? "-" : size(bytes) + "/s"; }

function left(seconds) {
  if (seconds === null || seconds === undefined) return "";
  return seconds >= 3600 ? (seconds / 3600).toFixed(1) + " h left" : seconds >= 60 ? Math.round(seconds / 60) + " min left" : Math.round(seconds) + " s left";
}

const MODEL_ACTIONS = { retry: ["Failed", "Canceled", "Interrupted"], cancel: ["Queued", "Downloading"], remove: null };

function drawModels(models) {
  const box = $("models-body");
  clear(box);
  if (!models.available) { box.appendChild(el("p", "muted", "not available (the model library is not connected)")); return; }
  const data = models.data;
  if (!data.queueRunning) box.appendChild(el("p", "muted", "the library's service is not running: downloads wait for lucia-models"));
  if (!data.models.length) box.appendChild(el("p", "muted", "No model in the library."));
  for (const model of data.models) {
    const item = el("div", "model");
    item.dataset.model = model.id;
    const title = el("h3");
    title.appendChild(el("span", "name", model.name));
    title.appendChild(el("span", "state state-" + model.state.toLowerCase(), model.state));
    item.appendChild(title);
    item.appendChild(el("p", "source", model.repo + " @ " + model.revision + (model.commit && model.commit !== model.revision ? " (" + model.commit.slice(0, 12) + ")" : "")));
    const bar = el("div", "bar progress");
    const done = el("span", "seg-0");
    const fraction = model.bytesTotal ? model.bytesDone / model.bytesTotal : 0;
    done.style.width = (100 * fraction).toFixed(2) + "%";
    bar.appendChild(done);
    bar.dataset.done = String(model.bytesDone);
    bar.dataset.total = String(model.bytesTotal);
    item.appendChild(bar);
    const figures = [size(model.bytesDone) + " / " + size(model.bytesTotal) + " (" + (100 * fraction).toFixed(1) + "%)"];
    if (model.speed !== null) figures.push(rate(model.speed));
    if (model.secondsLeft !== null) figures.push(left(model.secondsLeft));
    item.appendChild(el("p", "figures", figures.join(" · ")));
    if (model.message) item.appendChild(el("p", "message", model.message));
    for (const [action, states] of Object.entries(MODEL_ACTIONS)) {
      if (states && !states.includes(model.state)) continue;
      const button = el("button", "act-" + action, action[0].toUpperCase() + action.slice(1));
      button.type = "button";
      button.addEventListener("click", () => modelAction(model, action));
      item.appendChild(button);
    }
    box.appendChild(item);
  }
}

async function modelAction(model, action) {
  if (action === "remove" && !window.confirm("Remove " + model.name + " and its files?")) return;
  try { await call("POST", "models/" + encodeURIComponent(model.id) + "/" + action, {}); refresh(); }
  catch (error) { showProblem(model.name + ": " + error.message); }
}

async function addModel(event) {
  event.preventDefault();
  const body = { repo: $("model-repo").value, revision: $("model-revision").value || "main",
    include: $("model-include").value.split(/\s+/).filter(Boolean), name: $("model-name").value || null };
  try {
    await call("POST", "models", body);
    for (const id of ["model-repo", "model-revision", "model-include", "model-name"]) $(id).value = "";
    refresh();
  } catch (error) { showProblem("add: " + error.message); }
}

function seconds(value) { return value === null || value === undefined ? "-" : value.toFixed(3) + " s"; }

function table(cls, header, rows) {
  const t = el("table", cls);
  const head = el("tr");
  for (const name of header) head.appendChild(el("th", null, name));
  t.appendChild(el("thead")).appendChild(head);
  const body = el("tbody");
  for (const cells of rows) {
    const tr = el("tr");
    for (const cell of cells) tr.appendChild(el("td", null, cell));
    body.appendChild(tr);
  }
  t.appendChild(body);
  return t;
}

function buildName(b) {
  return [b.engine, b.engineVersion, (b.imageId || "").replace("sha256:", "").slice(0, 12), b.weightsRevision].join(" · ");
}

function drawTraffic(traffic) {
  const box = $("traffic-body");
  clear(box);
  if (!traffic.available) { box.appendChild(el("p", "muted", "not available (the record is off)")); return; }
  const data = traffic.data;
  if (data.problem) { box.appendChild(el("p", "problem", data.problem)); return; }
  for (const [span, title] of [["hour", "Last hour"], ["day", "Last day"]]) {
    const part = data[span];
    const div = el("div", "span span-" + span);
    div.appendChild(el("h3", null, title));
    const refused = Object.entries(part.refusals).map(([code, n]) => code + " " + n).join(", ");
    div.appendChild(el("p", "totals", part.requests + " requests; refused: " + (refused || "none")));
    if (part.byModel.length) {
      div.appendChild(table("by-model", ["Model", "Requests", "OK", "TTFT p50", "TTFT p95"],
        part.byModel.map((g) => [g.model, g.requests, g.ok, seconds(g.ttftSeconds.p50), seconds(g.ttftSeconds.p95)])));
      div.appendChild(table("by-build", ["Build", "Requests", "TTFT p50", "TTFT p95"],
        part.byBuild.map((g) => [buildName(g), g.requests, seconds(g.ttftSeconds.p50), seconds(g.ttftSeconds.p95)])));
    }
    box.appendChild(div);
  }
  box.appendChild(el("h3", null, "TTFT p50 per hour and build, last day"));
  box.appendChild(chart(data.chart));
}

const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

function chart(data) {
  const W = 640, H = 180, L = 48, R = 8, T = 8, B = 22;
  const wrap = el("div", "chart");
  const from = Date.parse(data.since), to = Date.parse(data.until);
  const points = data.builds.flatMap((b) => b.points);
  if (!points.length) { wrap.appendChild(el("p", "muted", "no time to first token in the last day")); return wrap; }
  const top = Math.max(...points.map((p) => p.p50)) * 1.1 || 1;
  // each hour at its middle; the hour under way at most at now
  const x = (at) => L + (W - L - R) * (Math.min(Date.parse(at) + 1800000, to) - from) / (to - from);
  const y = (v) => T + (H - T - B) * (1 - v / top);
  const pic = svg("svg", { viewBox: "0 0 " + W + " " + H, role: "img", class: "ttft-chart" });
  pic.appendChild(svg("title", {}, "time to first token, median per hour, per build"));
  pic.appendChild(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }));
  pic.appendChild(svg("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }));
  pic.appendChild(svg("text", { x: L - 4, y: T + 10, class: "tick end" }, top.toFixed(2) + " s"));
  pic.appendChild(svg("text", { x: L - 4, y: H - B, class: "tick end" }, "0"));
  pic.appendChild(svg("text", { x: L, y: H - 6, class: "tick" }, data.since.slice(11, 16) + " (-24 h)"));
  pic.appendChild(svg("text", { x: W - R, y: H - 6, class: "tick end" }, data.until.slice(11, 16) + " UTC"));
  const legend = el("ul", "legend");
  data.builds.forEach((build, i) => {
    const cls = "series-" + (i % 4);
    const line = build.points.map((p) => x(p.at).toFixed(1) + "," + y(p.p50).toFixed(1)).join(" ");
    pic.appendChild(svg("polyline", { points: line, class: "series " + cls }));
    for (const p of build.points) {
      const dot = svg("circle", { cx: x(p.at).toFixed(1), cy: y(p.p50).toFixed(1), r: 3, class: "dot " + cls });
      dot.appendChild(svg("title", {}, p.at + ": " + seconds(p.p50) + " (" + p.n + " requests)"));
      pic.appendChild(dot);
    }
    const li = el("li");
    li.appendChild(el("span", "swatch " + cls));
    li.appendChild(el("span", "build-name", buildName(build)));
    legend.appendChild(li);
  });
  wrap.appendChild(pic);
  wrap.appendChild(legend);
  return wrap;
}

async function signIn(event) {
  event.preventDefault();
  const input = $("owner-key");
  try {
    const answer = await call("POST", "signin", { key: input.value });
    input.value = "";
    signedIn(answer.csrf);
  } catch (error) {
    const p = $("signin-problem");
    p.textContent = error.message;
    p.hidden = false;
  }
}

async function signOut() {
  try { await call("POST", "signout", {}); } catch (error) { /* signed out either way */ }
  signedOut();
}

async function createKey(event) {
  event.preventDefault();
  try {
    const answer = await call("POST", "keys", { name: $("key-name").value, expires: $("key-expires").value });
    $("key-secret").textContent = answer.secret;
    $("key-new").hidden = false;
    $("key-name").value = "";
    $("key-expires").value = "";
    refresh();
  } catch (error) { showProblem("create: " + error.message); }
}

function keyDone() {
  $("key-secret").textContent = "";
  $("key-new").hidden = true;
}

async function start() {
  $("signin").addEventListener("submit", signIn);
  $("signout").addEventListener("click", signOut);
  $("key-create").addEventListener("submit", createKey);
  $("key-done").addEventListener("click", keyDone);
  $("model-add").addEventListener("submit", addModel);
  try {
    const answer = await call("GET", "session");
    signedIn(answer.csrf);
  } catch (error) { signedOut(); }
}

document.addEventListener("DOMContentLoaded", start);
