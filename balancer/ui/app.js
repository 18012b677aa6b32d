// wslb operator dashboard (docs/dashboard.md). Plain JavaScript, no build step, no library.
//
// Rules this file keeps:
// - The token lives in sessionStorage and travels only in the Authorization header: never in a
//   URL (so never in a log, a Referer or the history). EventSource cannot send a header, so the
//   event stream is read with fetch() and parsed here.
// - Every value from the server is inserted with textContent or a plain attribute, never as
//   HTML: session keys, client addresses and reasons come from clients and workers.
// - The tables poll GET /backends and GET /sessions every second (and at once after an event);
//   the event feed is pushed by wslb (GET /events/stream), reconnecting with backoff.
"use strict";

(() => {
  const TOKEN_KEY = "wslb.admin.token";
  const POLL_MS = 1000;
  const WINDOW_S = 300; // sparklines: the last five minutes, sampled at each poll
  const FEED_MAX = 200;
  const STALL_MS = 45000; // no byte (not even the 15 s keepalive) for this long: reconnect
  const BACKOFF_MIN_MS = 500;
  const BACKOFF_MAX_MS = 15000;
  const STATES = new Set(["active", "draining", "drained", "down", "ejected"]);
  const SVG_NS = "http://www.w3.org/2000/svg";

  const $ = (id) => document.getElementById(id);

  // -- formatting: every function returns a string, for textContent ---------------------------

  const DASH = "\u2014";
  const isNum = (v) => typeof v === "number" && Number.isFinite(v);

  function num(v) {
    if (!isNum(v)) return DASH;
    if (Number.isInteger(v)) return String(v);
    return String(Number(v.toFixed(Math.abs(v) >= 10 ? 1 : 3)));
  }
  // "1 session", "2 sessions": a count and its noun in the number it needs.
  function count(v, noun, plural) {
    return `${num(v)} ${v === 1 ? noun : plural || `${noun}s`}`;
  }
  function pct(v) {
    return isNum(v) ? `${(v * 100).toFixed(v < 0.1 ? 1 : 0)}%` : DASH;
  }
  function ms(seconds) {
    return isNum(seconds) ? `${(seconds * 1000).toFixed(1)} ms` : DASH;
  }
  function pause(v) {
    return isNum(v) ? `${v < 10 ? v.toFixed(1) : Math.round(v)} ms` : "";
  }
  function dur(seconds) {
    if (!isNum(seconds)) return DASH;
    return seconds < 1 ? `${Math.round(seconds * 1000)} ms` : `${seconds.toFixed(1)} s`;
  }
  function age(seconds) {
    if (!isNum(seconds)) return DASH;
    const s = Math.max(0, Math.floor(seconds));
    if (s < 60) return `${s}s`;
    const m = Math.floor(s / 60);
    if (m < 60) return `${m}m ${String(s % 60).padStart(2, "0")}s`;
    return `${Math.floor(m / 60)}h ${String(m % 60).padStart(2, "0")}m`;
  }
  function clock(date) {
    return date.toLocaleTimeString([], { hour12: false });
  }
  function str(v) {
    return v === null || v === undefined ? DASH : String(v);
  }

  function setText(el, text) {
    if (el.textContent !== text) el.textContent = text;
  }
  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // -- status and errors ------------------------------------------------------------------

  function setStatus(text) {
    setText($("status"), text);
  }
  function showError(text) {
    const box = $("error");
    box.textContent = text;
    box.hidden = false;
  }
  function hideError() {
    $("error").hidden = true;
    $("error").textContent = "";
  }

  // -- the API ----------------------------------------------------------------------------

  class AuthError extends Error {}
  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  let run = null; // the signed-in session: {token, stopped, timer, inFlight, pending, abort}

  async function api(path, options = {}) {
    const headers = { Authorization: `Bearer ${run.token}`, ...(options.headers || {}) };
    const resp = await fetch(path, {
      ...options,
      headers,
      cache: "no-store",
      credentials: "omit",
      redirect: "error",
    });
    let body = null;
    try {
      body = await resp.json();
    } catch (_) {
      body = null;
    }
    if (resp.status === 401) throw new AuthError("wrong token");
    if (!resp.ok) {
      const message = body && typeof body.error === "string" ? body.error : resp.statusText;
      throw new ApiError(resp.status, `HTTP ${resp.status}: ${message}`);
    }
    return body;
  }

  // -- sign in and out --------------------------------------------------------------------

  function stop() {
    if (run === null) return;
    run.stopped = true;
    clearTimeout(run.timer);
    if (run.abort) run.abort.abort();
    run = null;
  }

  function clearData() {
    for (const row of backendRows.values()) row.tr.remove();
    backendRows.clear();
    for (const tr of sessionRows.values()) tr.remove();
    sessionRows.clear();
    history.clear();
    seenEvents.clear();
    lastSessions = [];
    lastUpdate = null;
    filterIds = "";
    $("feed").replaceChildren();
    const filter = $("filter");
    filter.replaceChildren(new Option("All backends", ""));
    setText($("sessions-count"), "");
    $("data").hidden = true;
  }

  function signedIn(yes) {
    $("token").hidden = yes;
    $("signin").hidden = yes;
    document.querySelector('label[for="token"]').hidden = yes;
    $("signout").hidden = !yes;
  }

  function refused() {
    stop();
    sessionStorage.removeItem(TOKEN_KEY);
    clearData();
    signedIn(false);
    setStatus("Not signed in.");
    showError(
      "Wrong admin token: wslb answered 401. `wslb ctl dashboard` on wslb's machine prints " +
        "the token (admin.token, $WSLB_ADMIN_TOKEN, or the file wslb logged at start).",
    );
    $("token").focus();
  }

  async function signIn(token) {
    stop();
    clearData();
    hideError();
    const me = { token, stopped: false, timer: null, inFlight: false, pending: false, abort: null };
    run = me;
    setStatus("Signing in\u2026");
    let backends;
    let sessions;
    try {
      [backends, sessions] = await Promise.all([api("/backends"), api("/sessions")]);
    } catch (e) {
      if (run !== me) return;
      if (e instanceof AuthError) {
        refused();
      } else {
        stop();
        setStatus("Not signed in.");
        showError(`Cannot reach the admin API: ${e.message}`);
      }
      return;
    }
    if (run !== me) return;
    sessionStorage.setItem(TOKEN_KEY, token);
    signedIn(true);
    $("data").hidden = false;
    render(backends, sessions);
    schedule(me, POLL_MS);
    feed(me);
  }

  function signOut() {
    stop();
    sessionStorage.removeItem(TOKEN_KEY);
    clearData();
    hideError();
    signedIn(false);
    setStatus("Signed out.");
  }

  // -- polling the tables -----------------------------------------------------------------

  function schedule(me, delay) {
    clearTimeout(me.timer);
    me.timer = setTimeout(() => tick(me), delay);
  }

  function pollNow() {
    if (run !== null) schedule(run, 0);
  }

  async function tick(me) {
    if (me.stopped) return;
    if (me.inFlight) {
      me.pending = true;
      return;
    }
    me.inFlight = true;
    try {
      const [backends, sessions] = await Promise.all([api("/backends"), api("/sessions")]);
      if (me.stopped) return;
      render(backends, sessions);
    } catch (e) {
      if (me.stopped) return;
      if (e instanceof AuthError) {
        refused();
        return;
      }
      const since = lastUpdate ? ` (the tables are from ${clock(lastUpdate)})` : "";
      setStatus(`Cannot update: ${e.message}; retrying every second${since}.`);
    } finally {
      me.inFlight = false;
    }
    if (me.stopped) return;
    schedule(me, me.pending ? 0 : POLL_MS);
    me.pending = false;
  }

  let lastUpdate = null;

  function render(backends, sessions) {
    lastUpdate = new Date();
    const now = lastUpdate.getTime() / 1000;
    renderBackends(Array.isArray(backends) ? backends : [], now);
    lastSessions = Array.isArray(sessions) ? sessions : [];
    renderSessions(now);
    setStatus(`Signed in. Updated ${clock(lastUpdate)}.`);
  }

  // -- backends ---------------------------------------------------------------------------

  const SIGNALS = [
    // floor: the least full scale of a sparkline (it scales to its window's highest value), so
    // that noise around zero stays a flat line.
    { key: "gpu_util", col: "gpu", fmt: pct, floor: 0.05 },
    { key: "kv_cache_usage", col: "kv", fmt: pct, floor: 0.05 },
    { key: "waiting", col: "queue", fmt: num, floor: 1 },
    { key: "tpot", col: "tpot", fmt: ms, floor: 0.001 },
  ];
  const backendRows = new Map(); // id -> {tr, cells, sparks, drainBtn, undrainBtn, busy}
  const history = new Map(); // id -> {signal key: [[t, v], ...]}

  function spark() {
    const svg = document.createElementNS(SVG_NS, "svg");
    svg.setAttribute("class", "spark");
    svg.setAttribute("viewBox", "0 0 80 20");
    svg.setAttribute("aria-hidden", "true");
    svg.setAttribute("focusable", "false");
    const base = document.createElementNS(SVG_NS, "line");
    for (const [k, v] of [["x1", 0], ["y1", 19], ["x2", 80], ["y2", 19]]) base.setAttribute(k, v);
    const line = document.createElementNS(SVG_NS, "polyline");
    svg.append(base, line);
    return { svg, line };
  }

  function drawSpark(sp, samples, floor, now) {
    // The x axis spans what was sampled, up to WINDOW_S: a fresh page draws a line at once.
    const from = samples.length ? Math.max(now - WINDOW_S, samples[0][0]) : now - WINDOW_S;
    const span = Math.max(now - from, 1);
    let max = floor;
    for (const [, v] of samples) max = Math.max(max, v);
    const points = samples.map(([t, v]) => {
      const x = ((t - from) / span) * 80;
      const y = 18 - (Math.min(v, max) / max) * 16;
      return `${x.toFixed(1)},${y.toFixed(1)}`;
    });
    sp.line.setAttribute("points", points.join(" "));
  }

  function makeBackendRow(id) {
    const tr = document.createElement("tr");
    tr.dataset.backend = id;
    const cells = {};
    const add = (col, className) => {
      const td = el(tr.children.length === 0 ? "th" : "td", className);
      if (td.tagName === "TH") td.scope = "row";
      td.dataset.col = col;
      tr.append(td);
      cells[col] = td;
      return td;
    };
    add("id", "id");
    add("pool", "col-pool");
    const stateTd = add("state");
    const badge = el("span", "state");
    const drain = el("span", "drain");
    const progress = document.createElement("progress");
    progress.hidden = true;
    const drainText = el("span");
    drain.dataset.col = "drain";
    drain.append(progress, drainText);
    const cluster = el("span", "cluster");
    cluster.dataset.col = "cluster";
    stateTd.append(badge, drain, cluster);
    cells.cluster = cluster;
    cells.badge = badge;
    cells.progress = progress;
    cells.drainText = drainText;
    add("health", "health");
    add("weight", "num");
    add("effective", "num");
    add("sessions", "num");
    add("held", "num");
    const sparks = {};
    for (const s of SIGNALS) {
      const td = add(s.col);
      const wrap = el("span", "signal");
      const value = el("span", "value");
      const sp = spark();
      wrap.append(value, sp.svg);
      td.append(wrap);
      cells[`${s.col}-value`] = value;
      sparks[s.key] = sp;
    }
    add("kv-headroom", "num");
    add("placement", "num");
    add("migrations", "num");
    add("failovers", "num");
    add("errors", "num");
    const actions = add("actions", "actions");
    const row = { tr, cells, sparks, busy: false };
    row.drainBtn = el("button", "", "Drain");
    row.undrainBtn = el("button", "", "Undrain");
    for (const b of [row.drainBtn, row.undrainBtn]) b.type = "button";
    row.drainBtn.addEventListener("click", () => act(row, id, "drain"));
    row.undrainBtn.addEventListener("click", () => act(row, id, "undrain"));
    actions.append(row.drainBtn, row.undrainBtn);
    return row;
  }

  function drainSummary(b) {
    const d = b.drain;
    if (b.state !== "draining" && b.state !== "drained") return { text: "", progress: null };
    if (!d || typeof d !== "object") return { text: b.state, progress: null };
    const migrated = d.migrated || 0;
    const closed = (d.closed_after_answer || 0) + (d.closed_at_timeout || 0);
    const total = d.sessions_at_start || 0;
    const failed = d.migration_failures || 0;
    const parts = [`${migrated} migrated`];
    if (closed) parts.push(`${closed} closed`);
    if (failed) parts.push(`${failed} could not move`);
    if (b.state === "draining") {
      const left = isNum(d.left) ? d.left : b.sessions;
      parts.push(`${left} left`);
      return { text: parts.join(", "), progress: [Math.min(migrated + closed, total), total] };
    }
    const took = isNum(d.finished) && isNum(d.started) ? ` in ${dur(d.finished - d.started)}` : "";
    return { text: `done${took}: ${parts.join(", ")}`, progress: null };
  }

  // Cluster mode: the drain state the instances share, beside this instance's own.
  function clusterSummary(b) {
    const c = b.cluster;
    if (!c || typeof c !== "object") return "";
    const reports = c.instances && typeof c.instances === "object" ? Object.values(c.instances) : [];
    const drained = reports.filter((r) => r && r.state === "drained").length;
    if (c.drained_everywhere) return `cluster: drained on every instance (${reports.length})`;
    if (c.state === "active" && drained === 0) return "";
    const left = reports.reduce((n, r) => n + (r && isNum(r.left) ? r.left : 0), 0);
    return `cluster: ${str(c.state)}, drained on ${drained} of ${count(reports.length, "instance")}, ${left} left`;
  }

  function updateBackendRow(row, b, now) {
    const c = row.cells;
    const state = STATES.has(b.state) ? b.state : "unknown";
    row.tr.className = `state-${state}`;
    setText(c.id, str(b.id));
    if (b.url) c.id.title = String(b.url);
    setText(c.pool, str(b.pool));
    c.badge.className = `state ${state}`;
    setText(c.badge, str(b.state));
    const health = b.health && typeof b.health === "object" ? b.health : {};
    let healthText = b.healthy ? "ok" : `down: ${health.reason || "unhealthy"}`;
    if (b.state === "ejected" && isNum(b.ejected_for)) {
      healthText += ` (ejected ${Math.ceil(b.ejected_for)}s more)`;
    }
    if (b.overloaded === true) healthText += ", overloaded";
    setText(c.health, healthText);
    c.health.title = isNum(health.since) ? `since ${clock(new Date(health.since * 1000))}` : "";
    setText(c.weight, num(b.weight));
    setText(c.effective, num(b.effective_weight));
    setText(c.sessions, num(b.sessions));
    setText(c.held, num(b.held));

    const signals = b.signals && typeof b.signals === "object" ? b.signals : {};
    let hist = history.get(b.id);
    if (!hist) {
      hist = {};
      history.set(b.id, hist);
    }
    for (const s of SIGNALS) {
      const v = signals[s.key];
      const samples = (hist[s.key] = (hist[s.key] || []).filter(([t]) => t >= now - WINDOW_S));
      if (isNum(v)) samples.push([now, v]);
      const valueEl = c[`${s.col}-value`];
      setText(valueEl, s.fmt(v));
      valueEl.classList.toggle("stale", Boolean(b.signals_stale));
      valueEl.title = b.signals_stale ? "stale: the static weight applies" : "";
      drawSpark(row.sparks[s.key], samples, s.floor, now);
    }

    setText(c["kv-headroom"], pct(b.kv_headroom));
    const k = b.counters && typeof b.counters === "object" ? b.counters : null;
    if (k) {
      // Why keys went elsewhere (balancer/selection.py): new keys passed over, keys that left.
      const sum = (prefix) =>
        Object.entries(k)
          .filter(([name, v]) => name.startsWith(prefix) && isNum(v))
          .reduce((n, [, v]) => n + v, 0);
      setText(c.placement, `${num(sum("refused_"))} / ${num(sum("moved_"))}`);
      c.placement.title =
        `refused: ${num(k.refused_bound)} above the bound, ${num(k.refused_load)} to a lighter ` +
        `worker, ${num(k.refused_kv)} for KV room; moved: ${num(k.moved_cost)} when it paid, ` +
        `${num(k.moved_ceiling)} at the ceiling`;
    } else {
      setText(c.placement, DASH);
    }
    setText(c.migrations, k ? num(k.migrated_away) : DASH);
    setText(c.failovers, k ? num(k.failed_over) : DASH);
    if (k) {
      setText(c.errors, num((k.connect_failures || 0) + (k.health_check_failures || 0)));
      c.errors.title =
        `${num(k.connect_failures)} connect failures, ` +
        `${num(k.health_check_failures)} failed health checks`;
    } else {
      setText(c.errors, DASH);
    }

    const drain = drainSummary(b);
    setText(c.drainText, drain.text);
    c.progress.hidden = drain.progress === null;
    if (drain.progress !== null) {
      const [done, total] = drain.progress;
      c.progress.max = Math.max(total, 1);
      c.progress.value = total > 0 ? done : 0;
      c.progress.setAttribute("aria-label", `drain of ${b.id}: ${done} of ${total} done`);
    }

    setText(c.cluster, clusterSummary(b));

    const operator = b.state === "draining" || b.state === "drained";
    row.drainBtn.disabled = row.busy || operator;
    row.undrainBtn.disabled = row.busy || !operator;
  }

  function renderBackends(list, now) {
    const tbody = $("backends").tBodies[0];
    const seen = new Set();
    list.forEach((b, i) => {
      const id = String(b.id);
      seen.add(id);
      let row = backendRows.get(id);
      if (!row) {
        row = makeBackendRow(id);
        backendRows.set(id, row);
      }
      updateBackendRow(row, b, now);
      if (tbody.children[i] !== row.tr) tbody.insertBefore(row.tr, tbody.children[i] || null);
    });
    for (const [id, row] of backendRows) {
      if (!seen.has(id)) {
        row.tr.remove();
        backendRows.delete(id);
        history.delete(id);
      }
    }
    $("backends").classList.toggle("has-pools", new Set(list.map((b) => b.pool)).size > 1);
    updateFilter([...seen]);
  }

  async function act(row, id, what) {
    if (run === null) return;
    row.busy = true;
    row.drainBtn.disabled = row.undrainBtn.disabled = true;
    try {
      await api(`/backends/${encodeURIComponent(id)}/${what}`, {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: "{}",
      });
      hideError();
    } catch (e) {
      if (e instanceof AuthError) {
        refused();
        return;
      }
      showError(`${what === "drain" ? "Drain" : "Undrain"} ${id} failed: ${e.message}`);
    } finally {
      row.busy = false;
      pollNow();
    }
  }

  // -- sessions ---------------------------------------------------------------------------

  const sessionRows = new Map(); // process + id -> tr
  let lastSessions = [];
  let filterIds = "";

  function updateFilter(ids) {
    const joined = ids.join("\u0000");
    if (joined === filterIds) return;
    filterIds = joined;
    const select = $("filter");
    const current = select.value;
    const options = [new Option("All backends", "")];
    for (const id of ids) options.push(new Option(id, id));
    select.replaceChildren(...options);
    select.value = ids.includes(current) ? current : "";
  }

  function makeSessionRow() {
    const tr = document.createElement("tr");
    const cols = [
      ["key", "th", "key"],
      ["backend", "td", ""],
      ["process", "td", "col-process num"],
      ["client", "td", ""],
      ["age", "td", "num"],
      ["in", "td", "num"],
      ["out", "td", "num"],
      ["migrations", "td", "num"],
      ["failovers", "td", "num"],
    ];
    for (const [col, tag, className] of cols) {
      const cell = el(tag, className);
      if (tag === "th") cell.scope = "row";
      cell.dataset.col = col;
      tr.append(cell);
    }
    return tr;
  }

  function renderSessions(now) {
    const filter = $("filter").value;
    const all = lastSessions;
    const shown = all
      .filter((s) => !filter || s.backend === filter)
      .sort((a, b) => (a.since || 0) - (b.since || 0) || String(a.id).localeCompare(String(b.id)));
    const tbody = $("sessions").tBodies[0];
    const seen = new Set();
    let multi = false;
    shown.forEach((s, i) => {
      const key = `${s.process ?? ""}\u0000${s.id}`;
      seen.add(key);
      let tr = sessionRows.get(key);
      if (!tr) {
        tr = makeSessionRow();
        sessionRows.set(key, tr);
      }
      if (s.process !== undefined && s.process !== null) multi = true;
      const cells = tr.children;
      const msgs = s.messages && typeof s.messages === "object" ? s.messages : {};
      const failover = s.failover && typeof s.failover === "object" ? s.failover : null;
      tr.dataset.session = String(s.id);
      tr.dataset.backend = String(s.backend);
      setText(cells[0], str(s.id));
      cells[0].title = String(s.id);
      setText(cells[1], str(s.backend));
      setText(cells[2], str(s.process));
      setText(cells[3], str(s.client));
      setText(cells[4], isNum(s.since) ? age(now - s.since) : DASH);
      setText(cells[5], num(msgs.client_to_worker));
      setText(cells[6], num(msgs.worker_to_client));
      setText(cells[7], num(s.migrations));
      setText(cells[8], failover ? num(failover.failovers) : DASH);
      if (tbody.children[i] !== tr) tbody.insertBefore(tr, tbody.children[i] || null);
    });
    for (const [key, tr] of sessionRows) {
      if (!seen.has(key)) {
        tr.remove();
        sessionRows.delete(key);
      }
    }
    $("sessions").classList.toggle("has-process", multi);
    setText(
      $("sessions-count"),
      filter ? `(${shown.length} of ${all.length})` : `(${all.length})`,
    );
  }

  // -- the event feed ---------------------------------------------------------------------

  const seenEvents = new Set(); // seq, time and kind: a reconnect's backlog repeats events

  function setFeedStatus(text) {
    setText($("feed-status"), text);
  }

  const sleep = (delay) => new Promise((resolve) => setTimeout(resolve, delay));

  async function feed(me) {
    let delay = BACKOFF_MIN_MS;
    while (!me.stopped) {
      const ctrl = new AbortController();
      me.abort = ctrl;
      let why;
      try {
        setFeedStatus("Event feed: connecting\u2026");
        const resp = await fetch("/events/stream", {
          headers: { Authorization: `Bearer ${me.token}`, Accept: "text/event-stream" },
          cache: "no-store",
          credentials: "omit",
          redirect: "error",
          signal: ctrl.signal,
        });
        if (me.stopped) return;
        if (resp.status === 401) {
          refused();
          return;
        }
        if (!resp.ok || !resp.body) {
          why = resp.status === 404 ? "this wslb has no event stream (404)" : `HTTP ${resp.status}`;
        } else {
          setFeedStatus("Event feed: live.");
          await readStream(resp.body, ctrl, me, () => {
            delay = BACKOFF_MIN_MS;
          });
          why = "the stream ended";
        }
      } catch (e) {
        why = ctrl.signal.aborted ? "no data for 45 s" : e.message;
      }
      if (me.stopped) return;
      setFeedStatus(`Event feed: ${why}; reconnecting in ${Math.round(delay / 100) / 10} s.`);
      await sleep(delay);
      delay = Math.min(delay * 2, BACKOFF_MAX_MS);
    }
  }

  async function readStream(body, ctrl, me, onData) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    let ev = { event: "", data: [] };
    let watchdog = setTimeout(() => ctrl.abort(), STALL_MS);
    const line = (text) => {
      if (text === "") {
        if (ev.data.length) dispatch(ev.event, ev.data.join("\n"));
        ev = { event: "", data: [] };
        return;
      }
      if (text.startsWith(":")) return; // a comment: the keepalive
      const colon = text.indexOf(":");
      const field = colon < 0 ? text : text.slice(0, colon);
      let value = colon < 0 ? "" : text.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "event") ev.event = value;
      else if (field === "data") ev.data.push(value);
    };
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done || me.stopped) return;
        clearTimeout(watchdog);
        watchdog = setTimeout(() => ctrl.abort(), STALL_MS);
        onData();
        buf += decoder.decode(value, { stream: true });
        for (;;) {
          const match = /\r\n|\r|\n/.exec(buf);
          if (match === null) break;
          // A lone CR at the end may be the first half of a CRLF: wait for the next chunk.
          if (match[0] === "\r" && match.index === buf.length - 1) break;
          line(buf.slice(0, match.index));
          buf = buf.slice(match.index + match[0].length);
        }
      }
    } finally {
      clearTimeout(watchdog);
      reader.cancel().catch(() => {});
    }
  }

  function dispatch(eventName, data) {
    let e;
    try {
      e = JSON.parse(data);
    } catch (_) {
      return;
    }
    if (!e || typeof e !== "object") return;
    const kind = typeof e.kind === "string" ? e.kind : eventName || "message";
    const key = `${e.seq}\u0000${e.time}\u0000${kind}\u0000${e.process ?? ""}`;
    if (seenEvents.has(key)) return;
    seenEvents.add(key);
    if (seenEvents.size > 4 * FEED_MAX) seenEvents.delete(seenEvents.values().next().value);
    addFeedItem(kind, e);
    pollNow(); // the tables follow the event at once, not at the next poll
  }

  function list(v) {
    return Array.isArray(v) ? v.map(String).join(", ") : str(v);
  }

  function describe(kind, e) {
    const s = (v) => str(v);
    switch (kind) {
      case "drain":
        if (e.phase === "finished") {
          const closed = (e.closed_after_answer || 0) + (e.closed_at_timeout || 0);
          const took = isNum(e.seconds) ? ` in ${dur(e.seconds)}` : "";
          const failed = e.migration_failures ? `, ${e.migration_failures} could not move` : "";
          return {
            text: `${s(e.backend)} drained${took}: ${num(e.migrated)} migrated${failed}, ${closed} closed`,
            bad: Boolean(e.migration_failures),
          };
        }
        return {
          text:
            `drain of ${s(e.backend)} started: ${count(e.sessions, "session")}, ` +
            (e.migrate === false ? "closing them after their answer" : "migrating them"),
          bad: false,
        };
      case "undrain":
        return { text: `${s(e.backend)} undrained: active again`, bad: false };
      case "migration": {
        const p = pause(e.pause_ms);
        if (e.ok) {
          return {
            text: `session ${s(e.session)} moved ${s(e.from)} \u2192 ${s(e.to)}${p ? `, pause ${p}` : ""}`,
            bad: false,
          };
        }
        return {
          text: `session ${s(e.session)} not moved from ${s(e.from)}: ${s(e.result)}`,
          bad: true,
        };
      }
      case "failover": {
        const p = pause(e.pause_ms);
        const ok = e.result === "resumed";
        return {
          text: ok
            ? `session ${s(e.session)} failed over ${s(e.from)} \u2192 ${s(e.to)}${p ? `, pause ${p}` : ""}`
            : `session ${s(e.session)} lost with ${s(e.from)}: ${s(e.result)}`,
          bad: !ok,
        };
      }
      case "detached": {
        const grace = isNum(e.grace_s) ? ` ${dur(e.grace_s)}` : "";
        return {
          text: `session ${s(e.session)}: client lost without a close; kept on ${s(e.backend)}${grace} for its resume`,
          bad: false,
        };
      }
      case "resumed": {
        const replayed = isNum(e.replayed_bytes) ? `, ${num(e.replayed_bytes)} bytes replayed` : "";
        return {
          text: `session ${s(e.session)} resumed on ${s(e.backend)} from message ${s(e.count)}${replayed}`,
          bad: false,
        };
      }
      case "state": {
        const reason = e.reason ? ` (${s(e.reason)})` : "";
        return {
          text: `${s(e.backend)}: ${s(e.from)} \u2192 ${s(e.to)}${reason}`,
          bad: e.to === "down" || e.to === "ejected",
        };
      }
      case "reload": {
        if (!e.ok) return { text: `reload failed: ${s(e.error)}`, bad: true };
        const r = e.report && typeof e.report === "object" ? e.report : {};
        const parts = ["added", "removed", "updated"]
          .filter((k) => Array.isArray(r[k]) && r[k].length)
          .map((k) => `${k} ${list(r[k])}`);
        return { text: `config reloaded${parts.length ? `: ${parts.join("; ")}` : ", no change"}`, bad: false };
      }
      case "restart": {
        if (e.phase === "failed") return { text: `restart failed (${s(e.reason)}): ${s(e.error)}`, bad: true };
        if (e.phase === "started") return { text: `restart: starting the code installed now`, bad: false };
        if (e.phase === "taken") {
          return {
            text: `restart: new code ${s(e.version)} took over ${count(e.sessions, "session")} from pid ${s(e.old_pid)} (${s(e.old_version)})`,
            bad: false,
          };
        }
        const sessions = e.sessions && typeof e.sessions === "object" ? e.sessions : {};
        return { text: `restart finished: ${count(sessions.moved ?? e.moved, "session")} moved in ${s(e.seconds)} s`, bad: false };
      }
      case "backend_added":
        return { text: `backend ${s(e.backend)} added to pool ${s(e.pool)}`, bad: false };
      case "backend_removed":
        return { text: `backend ${s(e.backend)} removed from pool ${s(e.pool)}`, bad: false };
      default: {
        const rest = { ...e };
        for (const k of ["seq", "time", "kind", "process"]) delete rest[k];
        return { text: JSON.stringify(rest), bad: false };
      }
    }
  }

  function addFeedItem(kind, e) {
    const { text, bad } = describe(kind, e);
    const li = el("li", `kind-${/^[a-z_]+$/.test(kind) ? kind : "other"}${bad ? " bad" : ""}`);
    li.dataset.kind = kind;
    if (e.session !== undefined) li.dataset.session = String(e.session);
    const when = isNum(e.time) ? new Date(e.time * 1000) : new Date();
    const time = el("time", "", clock(when));
    time.dateTime = when.toISOString();
    const where = e.process !== undefined && e.process !== null ? ` (process ${e.process})` : "";
    li.append(time, el("span", "kind", kind), el("span", "text", text + where));
    const feedList = $("feed");
    feedList.prepend(li);
    while (feedList.children.length > FEED_MAX) feedList.lastElementChild.remove();
  }

  // -- start ------------------------------------------------------------------------------

  function start() {
    $("login").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const input = $("token");
      const token = input.value.trim();
      input.value = "";
      if (token) signIn(token);
    });
    $("signout").addEventListener("click", signOut);
    $("filter").addEventListener("change", () => renderSessions(Date.now() / 1000));
    const saved = sessionStorage.getItem(TOKEN_KEY);
    if (saved) signIn(saved);
    else $("token").focus();
  }

  start();
})();
