// Type-checked by tests/test_client_js.py (tsc --strict, once with the DOM's types and once with
// Node's only): wslb.d.ts, reached through package.json's "exports", says what wslb.js does.
import {
  ResumableSocket,
  connect,
  type GoneReason,
  type ResumableSocketOptions,
  type ResumableSocketState,
  type WebSocketLike,
} from "wslb";

/** A WebSocket class as the option takes it (the browser's and ws's have this shape). */
class FakeSocket implements WebSocketLike {
  readyState = 0;
  binaryType = "blob";
  onopen: ((ev: any) => any) | null = null;
  onmessage: ((ev: any) => any) | null = null;
  onerror: ((ev: any) => any) | null = null;
  onclose: ((ev: any) => any) | null = null;
  constructor(readonly url: string, readonly protocols?: string | string[]) {}
  send(_data: any): void {}
  close(_code?: number, _reason?: string): void {}
}

const options: ResumableSocketOptions = {
  WebSocket: FakeSocket,
  key: "alice",
  keyParam: "session",
  protocols: ["chat"],
  binaryType: "arraybuffer",
  grace: 30000,
  connectTimeout: 10000,
  idleTimeout: 0,
  maxDelay: 8000,
  settle: 100,
  resume: { token: "t".repeat(32), count: 4 },
};
const s = new ResumableSocket(new URL("wss://chat.example.com/ws"), options);

s.onmessage = (ev) => console.log(ev.data);
s.onopen = (ev) => console.log(ev.type);
s.onresumed = (ev) => console.log(ev.from + 1);
s.onreconnecting = (ev) => console.log(ev.attempt + ev.delay, ev.why.length);
s.ongone = (ev) => {
  const reason: GoneReason = ev.reason;
  if (ev.code === 4404 && reason.resume === "unknown") s.restart();
  console.log(ev.unsent.length);
};
s.ongiveup = (ev) => console.log(ev.why, ev.unsent);
s.onclose = (ev) => console.log(ev.code, ev.reason.length, ev.unsent);
s.addEventListener("resumed", (ev) => console.log(ev.from.toFixed()));
s.addEventListener("gone", (ev) => console.log(ev.reason.reason), { once: true });
s.addEventListener("custom", () => {});
s.onmessage = null;

const state: ResumableSocketState = s.state;
const fields: [number, string, string, string] = [s.count, s.token, s.key, s.url];
console.log(state, fields);
s.send("text");
s.send(new Uint8Array(2));
s.close(4000, "bye");
s.close();

async function main(): Promise<void> {
  const c: ResumableSocket = await connect("ws://127.0.0.1:8080/ws", { WebSocket: FakeSocket });
  c.close();
}
void main;

// @ts-expect-error: read-only
s.count = 3;
// @ts-expect-error: `from` is a number
s.addEventListener("resumed", (ev) => ev.from.length);
// @ts-expect-error: not a state
const bad: ResumableSocketState = "half-open";
// @ts-expect-error: a resume needs its count
new ResumableSocket("ws://x", { resume: { token: "t" } });
void bad;
