"""Minimal chat client for wslb or a reference worker: send prompts, watch tokens stream.

    python examples/chat_client.py --url ws://127.0.0.1:8080/ws --session alice \\
        "hello there" "tell me more"

Prompts come from the arguments, else one per line from stdin. The session id goes both in the
``session`` query parameter and the ``X-Session-Id`` header, so the balancer routes it to the
worker holding the conversation and a reconnect with the same id continues it. ``--verify``
checks every token against ``backends.model.token_text`` (each exactly once, in order).

Resume (docs/resume.md; on unless ``--no-resume``) is ``wslb.client``'s: it keeps the session's
token and the count of data messages received, and when the connection is lost without a close
(a network change, an RST, a path gone silent) it reconnects with both and the answer goes on
where it was: nothing lost or repeated. What happens is printed on stderr from its events.
``--cut-after N`` shows it: the client cuts its own TCP connection (no close frame) after N
tokens of each answer, once, and resumes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from websockets.exceptions import WebSocketException

import wslb.client
from wslb.client import Event, GaveUp, Session, SessionClosed, SessionGone


def _verifier(enabled: bool) -> Callable[[str, int, int], str] | None:
    if not enabled:
        return None
    from backends.model import token_text  # needs the repo installed (pip install -e .)

    return token_text


def _show(event: Event) -> None:
    """The session's events on stderr."""
    d = event.detail
    if event.kind == "reconnecting" and d["attempt"] == 1:
        print(f"\n[connection lost ({d['why']}); resuming]", file=sys.stderr, flush=True)
    elif event.kind == "reconnecting":
        print(f"[try {d['attempt']} in {d['delay']:.1f}s: {d['why']}]", file=sys.stderr)
    elif event.kind == "resumed":
        print(f"[resumed from message {d['from']}]", file=sys.stderr, flush=True)


async def _recv(session: Session) -> dict[str, Any]:
    msg: dict[str, Any] = json.loads(await session.recv())
    return msg


async def _answer(
    session: Session,
    sid: str,
    check: Callable[[str, int, int], str] | None,
    cut_after: int | None,
) -> bool:
    """Print one streamed answer; False if the turn ended in an error."""
    expected_i = 0
    seen = 0
    while True:
        msg = await _recv(session)
        kind = msg.get("type")
        if kind == "token":
            seen += 1
            if seen == cut_after:
                print(f"\n[cutting the connection after {seen} tokens]", file=sys.stderr)
                session.drop()
            if check is not None:
                turn, i = int(msg["turn"]), int(msg["i"])
                if i != expected_i or msg["text"] != check(sid, turn, i):
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
    try:
        conn = await wslb.client.connect(
            url,
            key=session,
            grace=30.0 if resume else 0.0,  # no resume: a loss ends it
            on_event=_show,
            additional_headers={"X-Session-Id": session} if session else None,
        )
    except (OSError, TimeoutError, WebSocketException) as exc:  # refused, timed out, rejected
        print(f"[cannot connect to {url}: {exc}]", file=sys.stderr)
        return 1
    try:
        hello = await _recv(conn)
        print(f"[hello: worker={hello.get('worker')} session={hello.get('session')}]")
        sid = str(hello.get("session") or conn.key or "")
        async for prompt in _prompts(prompts):
            print(f"> {prompt}", flush=True)
            await conn.send(
                json.dumps({"type": "prompt", "text": prompt, "max_tokens": max_tokens})
            )
            await _answer(conn, sid, check, cut_after)
    except SessionGone as exc:
        print(f"\n[cannot resume: {exc}; a new connection starts a new session]", file=sys.stderr)
        return 1
    except GaveUp as exc:
        print(f"\n[connection lost: {exc}]", file=sys.stderr)
        return 1
    except SessionClosed as exc:
        print(f"\n[connection closed: {exc}]", file=sys.stderr)
        return 1
    finally:
        await conn.close()
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
