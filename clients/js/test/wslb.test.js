// node --test: the library against a real wslb, through a TCP relay the test cuts.
//
// tests/test_client_js.py starts reference workers, two wslb (resume grace 30 s and 1 s), a
// cut relay (tests/cutrelay.py) in front of each, and passes them in the environment:
//   WSLB_URL, WSLB_RELAY_CONTROL        ws:// through the relay to the wslb with grace 30 s,
//                                        and the relay's control (http://127.0.0.1:PORT)
//   WSLB_GRACE_URL, WSLB_GRACE_CONTROL  the same for the wslb with grace 1 s
// Without them only the tests that need no wslb run. `ws` must resolve from here (npm install
// in clients/js, or NODE_PATH: this loads it with require, which honours NODE_PATH).
import { test } from "node:test";
import assert from "node:assert/strict";
import { createRequire } from "node:module";
import net from "node:net";
import { once } from "node:events";
import { ResumableSocket, connect } from "../wslb.js";

// Node 18 has Web Crypto only as a module (browsers and Node 20 have the global).
globalThis.crypto ??= (await import("node:crypto")).webcrypto;
const require = createRequire(import.meta.url);
const WebSocket = require("ws");
const env = process.env;
const live = env.WSLB_URL ? {} : { skip: "no WSLB_URL (run by tests/test_client_js.py)" };
const TOKENS = 100; // 2 s at the reference worker's 50 tokens/s

/** Until `pred()` is truthy (polled every 10 ms); fails after `ms`, naming `what`. */
async function until(pred, what, ms = 15000) {
  const deadline = Date.now() + ms;
  while (!pred()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 10));
  }
}

/** A socket whose events (all but messages) and parsed messages are recorded. */
function watched(url, options = {}) {
  const s = new ResumableSocket(url, { WebSocket, ...options });
  s.log = [];
  s.msgs = [];
  for (const t of ["open", "resumed", "reconnecting", "gone", "giveup", "close"]) {
    s.addEventListener(t, (ev) => s.log.push(ev));
  }
  s.onmessage = (ev) => s.msgs.push(JSON.parse(ev.data));
  s.kinds = () => s.log.map((e) => e.type);
  return s;
}

/** A ws server playing wslb: `script(ws, url, n)` for its n-th connection (from 1). */
async function fakeWslb(script) {
  const wss = new WebSocket.WebSocketServer({ port: 0, host: "127.0.0.1" });
  await once(wss, "listening");
  const urls = [];
  wss.on("connection", (ws, req) => {
    urls.push(new URL(req.url, "ws://x"));
    script(ws, urls.at(-1), urls.length);
  });
  const close = () =>
    new Promise((r) => {
      for (const c of wss.clients) c.terminate();
      wss.close(r);
    });
  return { url: `ws://127.0.0.1:${wss.address().port}/ws?session=f`, urls, close };
}

async function cut(control, how, down) {
  const r = await fetch(`${control}/cut?how=${how}&down=${down}`, { method: "POST" });
  assert.equal(r.status, 200, await r.text());
}

async function hello(s) {
  await until(() => s.msgs.length >= 1, "hello");
  assert.equal(s.msgs[0].type, "hello");
}

/** Asks for TOKENS tokens, cuts after 5 of them; checks every token came once, in order. */
async function cutMidAnswer(how, down, options) {
  const s = watched(env.WSLB_URL, options);
  await hello(s);
  s.send(JSON.stringify({ type: "prompt", text: "tell me", max_tokens: TOKENS }));
  await until(() => s.msgs.length >= 6, "5 tokens");
  await cut(env.WSLB_RELAY_CONTROL, how, down);
  await until(() => s.msgs.at(-1).type === "done", "the answer's done", 30000);
  const tokens = s.msgs.filter((m) => m.type === "token").map((m) => m.i);
  assert.deepEqual(tokens, [...Array(TOKENS).keys()]);
  assert.equal(s.msgs.at(-1).tokens, TOKENS);
  assert.equal(s.count, TOKENS + 2); // hello, the tokens, done
  const kinds = s.kinds();
  assert.equal(kinds[0], "open");
  assert.equal(kinds.at(-1), "resumed", kinds.join(" "));
  assert.ok(kinds.slice(1, -1).every((k) => k === "reconnecting"), kinds.join(" "));
  assert.ok(kinds.length >= 3, kinds.join(" "));
  const resumed = s.log.at(-1);
  assert.ok(resumed.from >= 6 && resumed.from < TOKENS + 2, `from ${resumed.from}`);
  s.close();
  assert.equal(s.state, "closed");
  return s;
}

test("a new session: open, hello, the key and token in place", live, async () => {
  const s = watched(env.WSLB_URL);
  await hello(s);
  assert.deepEqual(s.kinds(), ["open"]);
  assert.equal(s.state, "open");
  assert.equal(s.count, 1);
  assert.match(s.token, /^[A-Za-z0-9_-]{32}$/);
  assert.equal(new URL(s.url).searchParams.get("session"), s.key);
  s.close(1000, "bye");
  assert.deepEqual(s.kinds(), ["open", "close"]);
  assert.equal(s.log[1].code, 1000);
  assert.throws(() => s.send("x"), /closed/);
});

test("an RST mid-answer, the network back after 1 s: the whole answer once", live, async () => {
  const s = await cutMidAnswer("rst", 1);
  assert.equal(s.log[1].why, "lost");
});

test("a silent drop mid-answer: the idle probe resumes it", live, async () => {
  const s = await cutMidAnswer("silent", 1, { idleTimeout: 500 });
  assert.equal(s.log[1].why, "idle");
});

test("sends while reconnecting are queued and go out after the resume", live, async () => {
  const s = watched(env.WSLB_URL);
  await hello(s);
  await cut(env.WSLB_RELAY_CONTROL, "rst", 0.5);
  await until(() => s.state === "reconnecting", "reconnecting");
  s.send(JSON.stringify({ type: "prompt", text: "after", max_tokens: 3 }));
  await until(() => s.msgs.at(-1).type === "done", "the answer's done");
  assert.deepEqual(
    s.msgs.map((m) => m.type),
    ["hello", "token", "token", "token", "done"],
  );
  assert.equal(s.kinds().at(-1), "resumed");
  s.close();
});

test("a cut longer than grace: gone, then restart() opens a new session", live, async () => {
  const s = watched(env.WSLB_GRACE_URL, { grace: 15000 }); // wslb's grace is 1 s
  await hello(s);
  const { token, key } = s;
  await cut(env.WSLB_GRACE_CONTROL, "rst", 2.5);
  await until(() => s.state === "gone", "gone", 20000);
  const gone = s.log.at(-1);
  assert.equal(gone.type, "gone");
  assert.equal(gone.code, 4404);
  assert.deepEqual(gone.reason, { resume: "unknown" });
  assert.equal(s.kinds()[1], "reconnecting");
  assert.throws(() => s.send("x"), /gone/);
  s.restart();
  assert.equal(s.state, "connecting");
  assert.equal(s.count, 0);
  assert.notEqual(s.token, token);
  assert.equal(s.key, key);
  await until(() => s.msgs.length >= 2, "a second hello");
  assert.equal(s.msgs[1].type, "hello");
  assert.equal(s.kinds().at(-1), "open");
  assert.equal(s.count, 1);
  s.close();
});

test("the network down longer than the library's grace: giveup", live, async () => {
  const s = watched(env.WSLB_URL, { grace: 1500 });
  await hello(s);
  await cut(env.WSLB_RELAY_CONTROL, "rst", 3);
  await until(() => s.state === "giveup", "giveup");
  const giveup = s.log.at(-1);
  assert.equal(giveup.type, "giveup");
  assert.equal(giveup.why, "error");
  const waits = s.log.filter((e) => e.type === "reconnecting");
  assert.ok(waits.length >= 2, s.kinds().join(" "));
  assert.ok(waits[0].delay <= 100, `first retry after ${waits[0].delay} ms`);
  assert.ok(waits[1].delay >= 500 && waits[1].delay <= 1500, `then ${waits[1].delay} ms`);
  s.restart(); // tries again within a new grace (30 s here) until the network is back
  await until(() => s.kinds().at(-1) === "open", "a new session");
  s.close();
});

test("an idle connection: one probe resume loses nothing, then it goes on", live, async () => {
  const s = watched(env.WSLB_URL, { idleTimeout: 300 });
  await hello(s);
  s.send(JSON.stringify({ type: "prompt", text: "one", max_tokens: 3 }));
  await until(() => s.kinds().includes("resumed"), "the probe's resume");
  assert.deepEqual(s.kinds(), ["open", "reconnecting", "resumed"]);
  assert.equal(s.log[1].why, "idle");
  assert.equal(s.log[2].from, 5); // hello, 3 tokens, done
  s.send(JSON.stringify({ type: "prompt", text: "two", max_tokens: 2 }));
  await until(() => s.msgs.length === 8, "the second answer");
  assert.deepEqual(
    s.msgs.map((m) => m.type),
    ["hello", "token", "token", "token", "done", "token", "token", "done"],
  );
  s.close();
});

test("a stale token: gone with wslb's reason", live, async () => {
  const token = "T".repeat(32);
  const s = watched(env.WSLB_URL, { resume: { token, count: 3 } });
  await until(() => s.state === "gone", "gone");
  assert.deepEqual(s.kinds(), ["gone"]);
  assert.equal(s.log[0].code, 4404);
  assert.deepEqual(s.log[0].reason, { resume: "unknown" });
  await assert.rejects(connect(env.WSLB_URL, { WebSocket, resume: { token, count: 3 } }), /gone/);
});

test("a count ahead of the session: gone, refused", live, async () => {
  const a = watched(env.WSLB_URL);
  await hello(a);
  const b = watched(env.WSLB_URL, { key: a.key, resume: { token: a.token, count: 99 } });
  await until(() => b.state === "gone", "gone");
  assert.equal(b.log[0].code, 4409);
  assert.deepEqual(b.log[0].reason, { resume: "refused", reason: "count_ahead" });
  a.close();
});

test("a malformed token: gone, invalid", live, async () => {
  const s = watched(env.WSLB_URL, { resume: { token: "short", count: 0 } });
  await until(() => s.state === "gone", "gone");
  assert.equal(s.log[0].code, 4400);
  assert.deepEqual(s.log[0].reason, { resume: "invalid", reason: "token" });
});

test("1012 '...: resume' is a loss (resumed from the count); another close ends", async () => {
  const f = await fakeWslb((ws, url, n) => {
    if (n === 1) {
      ws.send("a");
      ws.send("b");
      ws.close(1012, "wslb stopping: resume");
    } else {
      ws.send("c");
      ws.close(1011, "worker failed");
    }
  });
  const s = new ResumableSocket(f.url, { WebSocket });
  const kinds = [];
  const data = [];
  for (const t of ["open", "resumed", "reconnecting", "gone", "giveup", "close"]) {
    s.addEventListener(t, (ev) => kinds.push(t === "reconnecting" ? `${t} ${ev.why}` : t));
  }
  s.onmessage = (ev) => data.push(String(ev.data));
  await until(() => s.state === "closed", "closed");
  assert.deepEqual(kinds, ["open", "reconnecting handover", "resumed", "close"]);
  assert.deepEqual(data, ["a", "b", "c"]);
  assert.equal(f.urls[0].searchParams.get("wslb_from"), null);
  assert.equal(f.urls[1].searchParams.get("wslb_from"), "2");
  assert.equal(f.urls[1].searchParams.get("wslb_resume"), s.token);
  assert.equal(f.urls[1].searchParams.get("session"), "f");
  await f.close();
});

test("4429: waits retry_after, then resumes", async () => {
  const f = await fakeWslb((ws, url, n) => {
    if (n === 1) ws.send("a", () => ws.terminate()); // lost: no close frame
    else if (n === 2) ws.close(4429, '{"resume":"throttled","retry_after":1}');
    else ws.send("b");
  });
  const s = watched(f.url);
  s.onmessage = (ev) => s.msgs.push(String(ev.data));
  await until(() => s.msgs.length === 2, "b", 8000);
  assert.deepEqual(s.msgs, ["a", "b"]);
  const waits = s.log.filter((e) => e.type === "reconnecting");
  assert.deepEqual(waits.map((e) => e.why), ["lost", "throttled"]);
  assert.ok(waits[1].delay >= 1000 && waits[1].delay <= 1500, `${waits[1].delay} ms`);
  assert.equal(s.kinds().at(-1), "resumed");
  assert.equal(f.urls[2].searchParams.get("wslb_from"), "1");
  s.close();
  await f.close();
});

test("a window's offline then online: resumes at once", async () => {
  const win = new EventTarget();
  globalThis.addEventListener = win.addEventListener.bind(win);
  globalThis.removeEventListener = win.removeEventListener.bind(win);
  try {
    const f = await fakeWslb((ws, url, n) => ws.send(`hi ${n}`));
    const s = watched(f.url, { idleTimeout: 0 });
    s.onmessage = (ev) => s.msgs.push(String(ev.data));
    await until(() => s.state === "open", "open");
    win.dispatchEvent(new Event("online")); // not offline before: nothing to do
    win.dispatchEvent(new Event("offline"));
    assert.equal(s.state, "open");
    win.dispatchEvent(new Event("online"));
    assert.equal(s.state, "reconnecting");
    await until(() => s.kinds().at(-1) === "resumed", "resumed");
    assert.deepEqual(s.kinds(), ["open", "reconnecting", "resumed"]);
    assert.equal(s.log[1].why, "online");
    assert.deepEqual(s.msgs, ["hi 1", "hi 2"]);
    assert.equal(f.urls.length, 2);
    s.close();
    await f.close();
  } finally {
    delete globalThis.addEventListener;
    delete globalThis.removeEventListener;
  }
});

test("nothing listening: retries, then giveup within grace", async () => {
  const server = net.createServer();
  await new Promise((r) => server.listen(0, "127.0.0.1", r));
  const port = server.address().port;
  await new Promise((r) => server.close(r)); // the port is free again: connects are refused
  const s = watched(`ws://127.0.0.1:${port}/ws?session=k1`, { grace: 1200 });
  s.send("queued");
  await until(() => s.state === "giveup", "giveup", 5000);
  assert.deepEqual(s.log.at(-1).unsent, ["queued"]);
  assert.ok(s.kinds().includes("reconnecting"));
  assert.equal(s.key, "k1");
});

test("a connect that never opens times out and is retried", async () => {
  const held = [];
  const server = net.createServer((c) => held.push(c)); // accepts, never answers
  await new Promise((r) => server.listen(0, "127.0.0.1", r));
  const url = `ws://127.0.0.1:${server.address().port}/`;
  const s = watched(url, { connectTimeout: 200, grace: 1000 });
  await until(() => s.state === "giveup", "giveup", 5000);
  assert.equal(s.log.at(-1).why, "timeout");
  for (const c of held) c.destroy();
  await new Promise((r) => server.close(r));
});

test("options and URLs: checked at once", () => {
  assert.throws(() => new ResumableSocket("ftp://x/", { WebSocket }), /not a WebSocket URL/);
  assert.throws(() => new ResumableSocket("ws://x/", {}), /WebSocket option/);
  assert.throws(
    () => new ResumableSocket("ws://x/", { WebSocket, resume: { token: "t" } }),
    /resume must be/,
  );
  const s = new ResumableSocket("http://127.0.0.1:9/chat?x=1&wslb_from=4", {
    WebSocket,
    keyParam: "sid",
  });
  const u = new URL(s.url);
  assert.equal(u.protocol, "ws:");
  assert.equal(u.searchParams.get("x"), "1");
  assert.equal(u.searchParams.get("wslb_from"), null);
  assert.match(u.searchParams.get("sid"), /^[A-Za-z0-9_-]{22}$/);
  assert.throws(() => s.close(1006), RangeError);
  s.close();
  assert.equal(s.state, "closed");
});
