"""Minimal chat client for wslb or a reference worker: send prompts, watch tokens stream.

    python examples/chat_client.py --url ws://127.0.0.1:8080/ws --session alice \\
        "hello there" "tell me more"

Prompts come from the arguments, else one per line from stdin. The session id goes both in the
``session`` query parameter and the ``X-Session-Id`` header, so the balancer routes it to the
worker holding the conversation and a reconnect with the same id continues it. ``--verify``
checks every token against ``backends.model.token_text`` (each exactly once, in order).

Resume (docs/resume.md; on unless ``--no-resume``): the client keeps the token wslb returns in
the 101 (``X-WSLB-Resume-Token``) and counts the data messages it receives. When the connection
is lost without a close (a network change, an RST), it reconnects with the same session id, the
token and the count (``X-WSLB-Resume-From``) and the answer goes on where it was: nothing lost
or repeated. ``--cut-after N`` shows it: the client cuts its own TCP connection (no close
frame) after N tokens of each answer, once, and reconnects 0.5 s later.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

TOKEN_HEADER = "X-WSLB-Resume-Token"
FROM_HEADER = "X-WSLB-Resume-From"
RESUMED_HEADER = "X-WSLB-Resumed"
RETRY_DELAYS = (0.5, 1.0, 2.0, 4.0, 8.0)  # well within wslb's default 30 s grace


def with_session(url: str, session: str | None) -> str:
    """Add ``session=ID`` to the URL's query unless it already names one."""
    if not session:
        return url
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    if not any(key == "session" for key, _ in query):
        query.append(("session", session))
    return urlunsplit(parts._replace(query=urlencode(query)))


def _verifier(enabled: bool) -> Callable[[str, int, int], str] | None:
    if not enabled:
        return None
    from backends.model import token_text  # needs the repo installed (pip install -e .)

    return token_text


class ResumeRefused(Exception):
    """wslb answered 409: the session cannot be resumed (its grace ran out, or it ended)."""


class Chat:
    """One session's connection to wslb, that resumes after a loss when it can (SPEC section
    13): ``recv`` hides the reconnect; ``count`` is every data message received, over all the
    session's connections, as wslb counts them."""

    def __init__(self, url: str, session: str | None, resume: bool) -> None:
        self.url = with_session(url, session)
        self.headers = {"X-Session-Id": session} if session else {}
        self.resume = resume
        self.token: str | None = None
        self.count = 0
        self.ws: ClientConnection | None = None
        self.cut_after: int | None = None  # --cut-after: tokens of an answer before a cut

    async def open(self, resuming: bool = False) -> None:
        headers = dict(self.headers)
        if self.token is not None:
            headers[TOKEN_HEADER] = self.token
        if resuming:
            headers[FROM_HEADER] = str(self.count)
        self.ws = await connect(self.url, additional_headers=headers)
        response = self.ws.response
        made = response.headers.get("X-Session-Id") if response is not None else None
        if made:  # the key wslb made when none was given: a reconnect must name it
            self.url = with_session(self.url, made)
        if response is not None and self.resume:
            self.token = response.headers.get(TOKEN_HEADER, self.token)
            if resuming:
                print(f"[resumed from message {response.headers.get(RESUMED_HEADER)}]",
                      file=sys.stderr, flush=True)  # fmt: skip

    def resumable(self, exc: ConnectionClosed) -> bool:
        """A loss wslb keeps the session for: no close frame came (a close is an ending), and
        wslb gave a token (a worker reached directly gives none)."""
        return self.resume and self.token is not None and exc.rcvd is None

    async def reconnect(self) -> None:
        """Back on the same session; raises ``ResumeRefused`` on a 409, the last error when
        every try failed."""
        print(f"\n[connection lost after {self.count} messages; resuming]", file=sys.stderr)
        for k, delay in enumerate(RETRY_DELAYS):
            await asyncio.sleep(delay)
            try:
                await self.open(resuming=True)
                return
            except InvalidStatus as exc:
                if exc.response.status_code == 409:
                    raise ResumeRefused(exc.response.body.decode(errors="replace")) from None
                if k == len(RETRY_DELAYS) - 1:
                    raise
            except OSError:  # the network is not back yet
                if k == len(RETRY_DELAYS) - 1:
                    raise

    async def recv(self) -> dict[str, Any]:
        while True:
            assert self.ws is not None
            try:
                data = await self.ws.recv()
            except ConnectionClosed as exc:
                if not self.resumable(exc):
                    raise
                await self.reconnect()
                continue
            self.count += 1
            msg: dict[str, Any] = json.loads(data)
            return msg

    async def send(self, text: str) -> None:
        """Send ``text``; after a loss, on the resumed connection (a send that raised did not
        go out: the connection was already closed)."""
        while True:
            assert self.ws is not None
            try:
                await self.ws.send(text)
                return
            except ConnectionClosed as exc:
                if not self.resumable(exc):
                    raise
                await self.reconnect()

    def tokens_seen(self, n: int) -> None:
        """--cut-after: the TCP connection dies here, once per answer (no close frame)."""
        if self.cut_after is not None and n == self.cut_after and self.ws is not None:
            print(f"\n[cutting the connection after {n} tokens]", file=sys.stderr, flush=True)
            self.ws.transport.abort()


async def _answer(
    chat: Chat,
    session: str,
    check: Callable[[str, int, int], str] | None,
) -> bool:
    """Print one streamed answer; False if the turn ended in an error."""
    expected_i = 0
    seen = 0
    while True:
        msg = await chat.recv()
        kind = msg.get("type")
        if kind == "token":
            seen += 1
            chat.tokens_seen(seen)
            if check is not None:
                turn, i = int(msg["turn"]), int(msg["i"])
                if i != expected_i or msg["text"] != check(session, turn, i):
                    print(f"\n[unexpected token {msg}, wanted i={expected_i}]", file=sys.stderr)
                expected_i = i + 1
            print(msg["text"], end=" ", flush=True)
        elif kind == "done":
            print(
                f"\n[turn {msg['turn']}: {msg['tokens']} tokens, cached_tokens="
                f"{msg['cached_tokens']}, prefill_ms={msg['prefill_ms']}, worker={msg['worker']}]",
                flush=True,
            )
            return True
        elif kind == "error":
            print(f"[error: {msg.get('error')}]", file=sys.stderr, flush=True)
            return False
        else:
            print(f"[{msg}]", flush=True)


async def _prompts(given: Sequence[str]) -> AsyncIterator[str]:
    """The given prompts, else stdin lines.

    Stdin is read by a daemon thread, so pings are answered while the user types and Ctrl-C
    does not wait for a pending line.
    """
    if given:
        for prompt in given:
            yield prompt
        return
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[str | None] = asyncio.Queue()

    def pump() -> None:
        try:
            for line in sys.stdin:
                loop.call_soon_threadsafe(lines.put_nowait, line)
            loop.call_soon_threadsafe(lines.put_nowait, None)
        except RuntimeError:  # the loop closed first
            pass

    threading.Thread(target=pump, name="stdin", daemon=True).start()
    while (line := await lines.get()) is not None:
        if line.strip():
            yield line.strip()


async def chat(
    url: str,
    session: str | None,
    prompts: Sequence[str],
    max_tokens: int,
    verify: bool,
    resume: bool = True,
    cut_after: int | None = None,
) -> int:
    """Send each prompt in turn on one session (resumed after a loss); return the exit status."""
    check = _verifier(verify)
    conn = Chat(url, session, resume)
    try:
        await conn.open()
        hello = await conn.recv()
        print(f"[hello: worker={hello.get('worker')} session={hello.get('session')}]")
        sid = str(hello.get("session") or session or "")
        async for prompt in _prompts(prompts):
            print(f"> {prompt}", flush=True)
            conn.cut_after = cut_after
            await conn.send(
                json.dumps({"type": "prompt", "text": prompt, "max_tokens": max_tokens})
            )
            await _answer(conn, sid, check)
    except ResumeRefused as exc:
        print(f"\n[cannot resume: {exc}; a new connection starts a new session]", file=sys.stderr)
        return 1
    except ConnectionClosed as exc:
        print(f"\n[connection closed: {exc}]", file=sys.stderr)
        return 1
    except (OSError, WebSocketException) as exc:  # refused, timed out, handshake rejected
        print(f"[cannot connect to {url}: {exc}]", file=sys.stderr)
        return 1
    finally:
        if conn.ws is not None:
            await conn.ws.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("prompts", nargs="*", help="prompts to send (default: lines of stdin)")
    parser.add_argument("--url", default="ws://127.0.0.1:8080/ws", help="default: %(default)s")
    parser.add_argument("--session", help="session id (default: the server picks one)")
    parser.add_argument("--max-tokens", type=int, default=32, help="default: %(default)s")
    parser.add_argument("--verify", action="store_true", help="check token texts and order")
    parser.add_argument(
        "--no-resume",
        dest="resume",
        action="store_false",
        help="do not resume after a connection loss (docs/resume.md)",
    )
    parser.add_argument(
        "--cut-after",
        type=int,
        metavar="N",
        help="demo: cut the TCP connection after N tokens of each answer, then resume",
    )
    args = parser.parse_args(argv)
    try:
        return asyncio.run(
            chat(
                args.url,
                args.session,
                args.prompts,
                args.max_tokens,
                args.verify,
                args.resume,
                args.cut_after,
            )
        )
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
