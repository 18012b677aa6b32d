// Type declarations for wslb.js: a WebSocket that resumes by itself through wslb.

/** The part of a WebSocket object the library uses (the browser's, or the `ws` package's). */
export interface WebSocketLike {
  readonly readyState: number;
  binaryType: string;
  onopen: ((ev: any) => any) | null;
  onmessage: ((ev: any) => any) | null;
  onerror: ((ev: any) => any) | null;
  onclose: ((ev: any) => any) | null;
  send(data: any): void;
  close(code?: number, reason?: string): void;
  /** `ws` only: drop the connection without a close frame. */
  terminate?(): void;
}

export interface WebSocketClass {
  new (url: string, protocols?: string | string[]): WebSocketLike;
}

export interface ResumableSocketOptions {
  /** The WebSocket class; default `globalThis.WebSocket` (Node: pass `ws`'s). */
  WebSocket?: WebSocketClass;
  /** The session key; default the URL's `keyParam`, else a random one added to the URL. */
  key?: string;
  /** The query parameter that carries the key (the pool's `session_key`); default "session". */
  keyParam?: string;
  /** Subprotocols, as the WebSocket constructor takes them. */
  protocols?: string | string[];
  /** Set on every socket: "blob" or "arraybuffer" (ws also takes "nodebuffer", "fragments"). */
  binaryType?: string;
  /** ms after a loss within which to resume (the pool's `resume.grace`); default 30000. */
  grace?: number;
  /** ms for one connect to open; default 10000. */
  connectTimeout?: number;
  /** ms without a send or receive after one, then resume once as a probe; 0 off; default 30000. */
  idleTimeout?: number;
  /** The longest backoff delay before jitter, ms; default 8000. */
  maxDelay?: number;
  /** ms an open socket must stay open (without a message) before it counts as open; default 100. */
  settle?: number;
  /** Resume a session held before (e.g. across a page load): its token and count. */
  resume?: { token: string; count: number };
}

export type ResumableSocketState =
  | "connecting"
  | "open"
  | "reconnecting"
  | "gone"
  | "giveup"
  | "closed";

/** The JSON reason of a 4xxx close, e.g. `{resume: "unknown"}`, `{resume: "refused",
 * reason: "count_ahead"}`; `{message}` when the reason is not JSON. */
export interface GoneReason {
  resume?: "unknown" | "closed" | "refused" | "taken" | "invalid" | string;
  reason?: string;
  message?: string;
  [field: string]: unknown;
}

export type WslbEvent<P> = Event & Readonly<P>;

export interface ResumableSocketEventMap {
  /** A new session is open (first connect or restart()). */
  open: WslbEvent<{}>;
  /** The session was resumed; the next message is message `from`, nothing lost. */
  resumed: WslbEvent<{ from: number }>;
  /** A try to (re)connect comes in `delay` ms. */
  reconnecting: WslbEvent<{ attempt: number; delay: number; why: string }>;
  /** wslb says the session cannot be resumed (4404, 4409, 4400): restart() for a new one. */
  gone: WslbEvent<{ code: number; reason: GoneReason; unsent: any[] }>;
  /** No resume within `grace`: the network is still down. */
  giveup: WslbEvent<{ why: string; unsent: any[] }>;
  /** The session ended: a close frame from wslb, or close(). */
  close: WslbEvent<{ code: number; reason: string; unsent: any[] }>;
  /** A data message of the session (counted). */
  message: WslbEvent<{ data: any }>;
}

/** As EventTarget's, spelled out so that the types need neither the DOM lib nor @types/node. */
type ListenerOptions = boolean | { capture?: boolean; once?: boolean; passive?: boolean; signal?: AbortSignal };
type AnyListener = ((ev: Event) => any) | { handleEvent(ev: Event): any } | null;

type Handler<K extends keyof ResumableSocketEventMap> =
  | ((this: ResumableSocket, ev: ResumableSocketEventMap[K]) => any)
  | null;

export class ResumableSocket extends EventTarget {
  constructor(url: string | URL, options?: ResumableSocketOptions);
  /** The URL without the resume parameters, with the key. */
  readonly url: string;
  readonly key: string;
  readonly token: string;
  /** Data messages received in this session, over all its connections. */
  readonly count: number;
  readonly state: ResumableSocketState;
  onopen: Handler<"open">;
  onresumed: Handler<"resumed">;
  onreconnecting: Handler<"reconnecting">;
  ongone: Handler<"gone">;
  ongiveup: Handler<"giveup">;
  onclose: Handler<"close">;
  onmessage: Handler<"message">;
  /** Sends now when open, else queues until the (re)connect; throws once ended. */
  send(data: any): void;
  /** Ends the session (code 1000 or 3000-4999); `close` fires at once. */
  close(code?: number, reason?: string): void;
  /** A new session on the same key: a new token, the count from 0. */
  restart(): void;
  addEventListener<K extends keyof ResumableSocketEventMap>(
    type: K,
    listener: (this: ResumableSocket, ev: ResumableSocketEventMap[K]) => any,
    options?: ListenerOptions,
  ): void;
  addEventListener(
    type: string,
    listener: AnyListener,
    options?: ListenerOptions,
  ): void;
  removeEventListener<K extends keyof ResumableSocketEventMap>(
    type: K,
    listener: (this: ResumableSocket, ev: ResumableSocketEventMap[K]) => any,
    options?: ListenerOptions,
  ): void;
  removeEventListener(
    type: string,
    listener: AnyListener,
    options?: ListenerOptions,
  ): void;
}

/** A ResumableSocket once open (or resumed); rejects if it is gone, gives up or closes first
 * (the error's `event` is that event). */
export function connect(url: string | URL, options?: ResumableSocketOptions): Promise<ResumableSocket>;
