"""Minimal chat client for wslb or a reference worker: send prompts, watch tokens stream.

    python examples/chat_client.py --url ws://127.0.0.1:8080/ws --session alice \\
        "hello there" "tell me more"

Prompts come from the arguments, else one per line from stdin. The session id goes both in the
``session`` query parameter and the ``X-Session-Id`` header, so the balancer routes it to the
worker holding the conversation and a reconnect with the same id continues it. ``--verify``
checks every token against ``backends.model.token_text`` (each exactly once, in order).
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
from websockets.exceptions import ConnectionClosed, WebSocketException


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


async def _answer(
    ws: ClientConnection,
    session: str,
    check: Callable[[str, int, int], str] | None,
) -> bool:
    """Print one streamed answer; False if the turn ended in an error."""
    expected_i = 0
    while True:
        msg: dict[str, Any] = json.loads(await ws.recv())
        kind = msg.get("type")
        if kind == "token":
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
    url: str, session: str | None, prompts: Sequence[str], max_tokens: int, verify: bool
) -> int:
    """Send each prompt in turn on one connection; return the exit status."""
    headers = {"X-Session-Id": session} if session else None
    check = _verifier(verify)
    try:
        async with connect(with_session(url, session), additional_headers=headers) as ws:
            hello: dict[str, Any] = json.loads(await ws.recv())
            print(f"[hello: worker={hello.get('worker')} session={hello.get('session')}]")
            sid = str(hello.get("session") or session or "")
            async for prompt in _prompts(prompts):
                print(f"> {prompt}", flush=True)
                await ws.send(
                    json.dumps({"type": "prompt", "text": prompt, "max_tokens": max_tokens})
                )
                await _answer(ws, sid, check)
    except ConnectionClosed as exc:
        print(f"\n[connection closed: {exc}]", file=sys.stderr)
        return 1
    except (OSError, WebSocketException) as exc:  # refused, timed out, handshake rejected
        print(f"[cannot connect to {url}: {exc}]", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("prompts", nargs="*", help="prompts to send (default: lines of stdin)")
    parser.add_argument("--url", default="ws://127.0.0.1:8080/ws", help="default: %(default)s")
    parser.add_argument("--session", help="session id (default: the server picks one)")
    parser.add_argument("--max-tokens", type=int, default=32, help="default: %(default)s")
    parser.add_argument("--verify", action="store_true", help="check token texts and order")
    args = parser.parse_args(argv)
    try:
        return asyncio.run(chat(args.url, args.session, args.prompts, args.max_tokens, args.verify))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
