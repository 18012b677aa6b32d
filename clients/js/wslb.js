// wslb.js: a WebSocket that resumes by itself through wslb (docs/resume.md, the query form).
// One dependency-free ES module, for browsers (the global WebSocket) and Node (pass the `ws`
// package's class as the `WebSocket` option where there is no global one).
//
// A session is a key (`?session=K`, made up when the URL names none), a secret token (made
// here: 24 random bytes, base64url) and a count of the data messages received in it over all
// its connections. Every connect names the token (`wslb_resume=T`); a resume adds the count
// (`wslb_from=N`). wslb answers a browser only in ways a WebSocket object shows:
//
//   what the socket shows                         what it means              what we do
//   open, still open `settle` ms later or a       new session / resumed      `open` / `resumed`
//     message first                                 from exactly N
//   close 4404 (unknown, closed), 4409 (refused,  this session is gone       `gone` {code, reason}
//     taken), 4400 (invalid)                                                 and stop
//   close 4429 {retry_after: S}                   throttled                  retry after S s
//   close 1006 before open (error, HTTP error)    unreachable                retry (backoff)
//   close 1006 after open; 1012 ".. : resume"     lost (no close frame)      resume (backoff)
//   any other close                               the session ended          `close` and stop
//
// A refusal is a 101 and a close frame written together, so the open comes first: an open is
// trusted only once a message arrives or the socket is still OPEN `settle` ms later (a
// received close frame turns it CLOSING at once).
//
// States (`state`) and their rules:
//   connecting   a new session's connect (constructor, restart()); failed tries are retried
//                within `grace`; sends are queued.
//   open         confirmed; sends go out; every send and receive re-arms the idle timer.
//   reconnecting a loss: tries to resume: the first at once (0-100 ms jitter), then 1 s, 2 s,
//                4 s ... capped at `maxDelay`, each x(0.5..1.5), all within `grace` of the
//                loss; each try has `connectTimeout`. Sends are queued and go out after the
//                resume (a send into a connection that turned out dead may be lost: wslb
//                replays only its own direction).
//   gone         wslb says the session cannot be resumed; restart() starts a new one.
//   giveup       no resume within `grace` (the network is still down); restart() to try again.
//   closed       ended by a close frame or close(); restart() opens a new session.
// Liveness, sending nothing of its own: `idleTimeout` ms without a send or receive after one
// -> resume once as a probe (a resume of a live connection loses nothing: wslb takes the old
// connection over); a window's `offline` marks, the next `online` resumes at once.
// A socket left behind is never closed with a close frame (that would end the session at
// wslb): its handlers are detached, and a `terminate()` (ws) drops its TCP without one.

const EVENTS = ["open", "resumed", "reconnecting", "gone", "giveup", "close", "message"];
const TERMINAL = new Set(["gone", "giveup", "closed"]);
const GONE_CODES = new Set([4400, 4404, 4409]);
const DEFAULTS = {
  keyParam: "session",
  grace: 30000,
  connectTimeout: 10000,
  idleTimeout: 30000,
  maxDelay: 8000,
  settle: 100,
};

/** An Event carrying the fields of `props` (`data`, `code`, `reason`, `from`, ...). */
class WslbEvent extends Event {
  constructor(type, props) {
    super(type);
    Object.assign(this, props);
  }
}

function randomId(bytes) {
  const b = crypto.getRandomValues(new Uint8Array(bytes));
  return btoa(String.fromCharCode(...b)).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

function parseReason(text) {
  try {
    const v = JSON.parse(text);
    if (v && typeof v === "object") return v;
  } catch {}
  return { message: text };
}

function jittered(ms) {
  return ms * (0.5 + Math.random());
}

export class ResumableSocket extends EventTarget {
  /**
   * @param {string | URL} url ws:, wss:, http(s): or (in a page) relative.
   * @param {object} [options] see wslb.d.ts.
   */
  constructor(url, options = {}) {
    super();
    const o = { ...DEFAULTS, ...options };
    this._WS = o.WebSocket ?? globalThis.WebSocket;
    if (typeof this._WS !== "function") {
      throw new TypeError("no WebSocket class: pass one as the WebSocket option (Node: ws)");
    }
    const u = new URL(String(url), globalThis.location?.href);
    u.protocol = u.protocol.replace(/^http/, "ws");
    if (u.protocol !== "ws:" && u.protocol !== "wss:") {
      throw new SyntaxError(`not a WebSocket URL: ${u.href}`);
    }
    for (const p of ["wslb_resume", "wslb_from"]) u.searchParams.delete(p);
    const key = o.key || u.searchParams.get(o.keyParam) || randomId(16);
    u.searchParams.set(o.keyParam, key);
    this._url = u;
    this._key = key;
    this._o = o;
    this._state = "connecting";
    this._queue = [];
    this._sock = null;
    this._timers = {};
    this._offline = false;
    for (const t of EVENTS) this["on" + t] = null;
    this._onOffline = () => (this._offline = true);
    this._onOnline = () => this._online();
    const r = o.resume;
    if (r != null && !(typeof r.token === "string" && Number.isSafeInteger(r.count) && r.count >= 0)) {
      throw new TypeError("resume must be {token: string, count: integer >= 0}");
    }
    this._new(r?.token, r?.count);
  }

  get url() { return this._url.href; }
  get key() { return this._key; }
  get token() { return this._token; }
  get count() { return this._count; }
  get state() { return this._state; }

  /** Sends now when open, else queues until the (re)connect; throws once the session ended. */
  send(data) {
    if (TERMINAL.has(this._state)) {
      throw new Error(`cannot send: the session is ${this._state}`);
    }
    if (this._state === "open") {
      this._sock.send(data);
      this._armIdle();
    } else {
      this._queue.push(data);
    }
  }

  /** Ends the session: a close frame on a live connection (wslb ends the session), and the
   * `close` event at once. A lost connection hears nothing: wslb ends it after its grace. */
  close(code = 1000, reason = "") {
    if (code !== 1000 && !(code >= 3000 && code <= 4999)) {
      throw new RangeError(`close code must be 1000 or 3000-4999, not ${code}`);
    }
    if (this._state === "closed") return;
    const live = !TERMINAL.has(this._state);
    this._closeLive(code, reason);
    this._finish("closed", live ? "close" : null, { code, reason });
  }

  /** A new session on the same key: a new token, the count from 0 (a live connection of the
   * old one is closed with 1000, which ends it). */
  restart() {
    this._closeLive(1000, "restart");
    this._finish("connecting", null);
    this._new();
  }

  // -- internals ---------------------------------------------------------------------------

  _new(token, count) {
    this._token = token ?? randomId(24);
    this._count = count ?? 0;
    this._resuming = token != null;
    this._state = "connecting";
    this._listen(true);
    this._begin(this._resuming ? "resume" : "open");
  }

  /** A loss, or a new connect: tries from now on, within grace. */
  _begin(why, delay = Math.random() * 100) {
    this._deadline = Date.now() + this._o.grace;
    this._attempt = 0;
    this._schedule(why, delay);
  }

  _schedule(why, delay) {
    const left = this._deadline - Date.now();
    if (left <= 0) return this._giveup(why);
    this._attempt += 1;
    delay = Math.min(delay, left);
    this._timer("try", delay, () => this._try());
    if (this._attempt > 1 || (why !== "open" && why !== "resume")) {
      this._emit("reconnecting", { attempt: this._attempt, delay, why });
    }
  }

  _retry(why) {
    const base = Math.min(1000 * 2 ** (this._attempt - 1), this._o.maxDelay);
    this._schedule(why, jittered(base));
  }

  _try() {
    const u = new URL(this._url);
    u.searchParams.set("wslb_resume", this._token);
    if (this._resuming) u.searchParams.set("wslb_from", String(this._count));
    let sock;
    try {
      sock = new this._WS(u.href, this._o.protocols);
    } catch (e) {
      return this._retry("error");
    }
    if (this._o.binaryType) sock.binaryType = this._o.binaryType;
    this._sock = sock;
    this._confirmed = false;
    const left = this._deadline - Date.now();
    const limit = Math.min(this._o.connectTimeout, Math.max(left, 1000));
    this._timer("connect", limit, () => {
      this._drop(sock);
      this._sock = null;
      this._retry("timeout");
    });
    sock.onopen = () => {
      this._timer("settle", this._o.settle, () => {
        if (sock.readyState === 1) this._confirm();
      });
    };
    sock.onmessage = (ev) => {
      if (!this._confirmed) this._confirm();
      if (this._sock !== sock) return; // the open or resumed handler ended it
      this._count += 1;
      this._armIdle();
      this._emit("message", { data: ev.data });
    };
    sock.onerror = () => {};
    sock.onclose = (ev) => this._closed(sock, ev.code, String(ev.reason ?? ""));
  }

  _confirm() {
    this._confirmed = true;
    this._clear("connect");
    this._clear("settle");
    const resumed = this._resuming;
    this._resuming = true;
    this._state = "open";
    const queue = this._queue;
    this._queue = [];
    for (const data of queue) this._sock.send(data);
    if (queue.length) this._armIdle();
    if (resumed) this._emit("resumed", { from: this._count });
    else this._emit("open", {});
  }

  _closed(sock, code, reason) {
    this._detach(sock);
    this._sock = null;
    for (const t of ["connect", "settle", "idle"]) this._clear(t);
    if (GONE_CODES.has(code)) {
      return this._finish("gone", "gone", { code, reason: parseReason(reason) });
    }
    const handover = code === 1012 && reason.endsWith(": resume");
    if (code !== 1006 && code !== 4429 && !handover) {
      return this._finish("closed", "close", { code, reason });
    }
    const why = handover ? "handover" : code === 4429 ? "throttled" : "lost";
    const after = code === 4429 ? (Number(parseReason(reason).retry_after) || 1) * 1000 : 0;
    if (this._confirmed) {
      this._state = "reconnecting"; // a loss after an open: resume, within grace from now
      this._begin(why, after || Math.random() * 100);
    } else if (after) {
      this._schedule(why, after * (1 + Math.random() / 2));
    } else {
      this._retry(handover ? why : "error");
    }
  }

  /** The connection may be dead though it never closed: resume on a new one. */
  _probe(why) {
    if (this._state !== "open") return;
    this._clear("idle");
    this._drop(this._sock);
    this._sock = null;
    this._state = "reconnecting";
    this._begin(why);
  }

  _online() {
    const was = this._offline;
    this._offline = false;
    if (this._state === "open" && was) this._probe("online");
    else if (!TERMINAL.has(this._state) && !this._sock && this._timers.try) {
      this._clear("try");
      this._try(); // waiting out a backoff: the network is back, try now
    }
  }

  _armIdle() {
    if (this._o.idleTimeout > 0) {
      this._timer("idle", this._o.idleTimeout, () => this._probe("idle"));
    }
  }

  _giveup(why) {
    this._finish("giveup", "giveup", { why });
  }

  /** Closes the current socket with a close frame if it is open (the app ends the session). */
  _closeLive(code, reason) {
    const sock = this._sock;
    if (sock && sock.readyState === 1) {
      this._detach(sock);
      this._sock = null;
      sock.close(code, reason);
    }
  }

  /** Into `state` with no timers, socket, queue or window listeners; then the event `type`
   * (if any) with `props` and the messages never sent (`unsent`). */
  _finish(state, type, props) {
    const unsent = this._queue;
    for (const name of Object.keys(this._timers)) this._clear(name);
    if (this._sock) this._drop(this._sock);
    this._sock = null;
    this._queue = [];
    this._state = state;
    this._listen(false);
    if (type) this._emit(type, { ...props, unsent });
  }

  _listen(on) {
    const g = globalThis;
    if (typeof g.addEventListener !== "function" || on === !!this._listening) return;
    this._listening = on;
    const method = on ? "addEventListener" : "removeEventListener";
    g[method]("offline", this._onOffline);
    g[method]("online", this._onOnline);
  }

  _detach(sock) {
    sock.onopen = sock.onmessage = sock.onclose = null;
    sock.onerror = () => {}; // ws throws an error event nobody listens to
  }

  /** Leave `sock` without a close frame: detached, its TCP dropped where the class can. */
  _drop(sock) {
    this._detach(sock);
    if (typeof sock.terminate === "function") sock.terminate();
    else if (sock.readyState === 0) sock.close(); // a connect in progress: no frame is sent
  }

  _timer(name, ms, fn) {
    this._clear(name);
    this._timers[name] = setTimeout(() => {
      delete this._timers[name];
      fn();
    }, ms);
  }

  _clear(name) {
    clearTimeout(this._timers[name]);
    delete this._timers[name];
  }

  _emit(type, props) {
    const ev = new WslbEvent(type, props);
    this.dispatchEvent(ev);
    const fn = this["on" + type];
    if (typeof fn === "function") {
      try {
        fn.call(this, ev);
      } catch (e) {
        queueMicrotask(() => {
          throw e;
        });
      }
    }
  }
}

/** A ResumableSocket once it is open; rejects if it gives up, is gone or closes first. */
export function connect(url, options) {
  return new Promise((resolve, reject) => {
    const s = new ResumableSocket(url, options);
    const done = (ev) => {
      for (const t of ["open", "resumed", "gone", "giveup", "close"]) {
        s.removeEventListener(t, done);
      }
      if (ev.type === "open" || ev.type === "resumed") resolve(s);
      else reject(Object.assign(new Error(`wslb: ${ev.type} before open`), { event: ev }));
    };
    for (const t of ["open", "resumed", "gone", "giveup", "close"]) s.addEventListener(t, done);
  });
}
