"""The official ``openai`` SDK through wslb, resuming after a network blip (docs/resume.md).

    pip install openai
    python examples/realtime_resume.py --session alice "tell me a long story"

An OpenAI Realtime (text) conversation, as ``examples/realtime_client.py``, that survives its
TCP connection dying mid-answer: the rest of the answer arrives, nothing lost or repeated, and
neither the SDK nor the worker behind wslb notices more than a short pause.

- The client names its session's resume secret itself (``extra_headers``:
  ``X-WSLB-Resume-Token``), so it need not read the 101's headers, which the SDK keeps to itself.
- It counts every server event it receives in this session: one event is one WebSocket
  message, the unit wslb counts in.
- The SDK reconnects by itself after an abnormal close (1006: no close frame, the network) and
  calls ``on_reconnecting`` first: the hook returns the token and the count
  (``X-WSLB-Resume-From``), and wslb sends the events from that one on. After a close wslb sent
  (1001, 1012: a drain, a restart), or when the resume keeps failing (a 409: the grace ran out),
  there is nothing to resume: the hook names a new token and counts from 0 again, which starts
  a new session with the same key (the worker still holds the conversation). A count is one
  session's: carried over into another, wslb refuses it (409). The SDK queues what the client
  sends meanwhile and sends it on the new connection.

``--cut-after N`` shows it without a network: the client aborts its own TCP connection (an RST,
no close frame) after N deltas of the first answer.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
from collections.abc import Sequence
from typing import Any

from openai import AsyncOpenAI
from openai.types.websocket_reconnection import ReconnectingEvent, ReconnectingOverrides

TOKEN_HEADER = "X-WSLB-Resume-Token"
FROM_HEADER = "X-WSLB-Resume-From"


RESUME_TRIES = 3  # reconnects that ask to resume before a new session is started


class Resume:
    """The session's token and the count of server events received in this session, over all
    its connections."""

    def __init__(self) -> None:
        self.token = secrets.token_urlsafe(24)  # 192 random bits (22-128 URL-safe characters)
        self.count = 0

    def headers(self) -> dict[str, str]:
        """The first connection's headers: the token only."""
        return {TOKEN_HEADER: self.token}

    def on_reconnecting(self, event: ReconnectingEvent) -> ReconnectingOverrides | None:
        """The SDK's reconnect hook: token and count after a loss; a new token and a count
        from 0 after a close from the server, or resumes that failed (a new session)."""
        headers = {k: v for k, v in dict(event.extra_headers).items() if k != FROM_HEADER}
        if event.close_code == 1006 and event.attempt <= RESUME_TRIES:  # the connection was lost
            headers[FROM_HEADER] = str(self.count)
        else:
            self.token, self.count = secrets.token_urlsafe(24), 0
        headers[TOKEN_HEADER] = self.token
        what = f"resume from event {self.count}" if FROM_HEADER in headers else "new session"
        print(
            f"\n[reconnecting after close {event.close_code} (attempt {event.attempt}): {what}]",
            file=sys.stderr,
            flush=True,
        )
        return {"extra_headers": headers}


def cut(conn: Any) -> None:
    """--cut-after: the TCP connection dies (no close frame), as on a network change."""
    ws = getattr(conn, "_connection", None)  # the SDK's websockets connection
    transport = getattr(ws, "transport", None)
    if transport is not None:
        print("\n[cutting the connection]", file=sys.stderr, flush=True)
        transport.abort()


async def chat(
    base_url: str, model: str, session: str | None, prompts: Sequence[str], cut_after: int | None
) -> int:
    client = AsyncOpenAI(base_url=base_url, api_key="not-needed-by-wslb")
    resume = Resume()
    query = {"session": session} if session else {}
    async with client.realtime.connect(
        model=model,
        extra_query=query,
        extra_headers=resume.headers(),
        on_reconnecting=resume.on_reconnecting,
    ) as conn:
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
        for turn, prompt in enumerate(prompts):
            print(f"> {prompt}")
            await conn.conversation.item.create(
                item={
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": prompt}],
                }
            )
            await conn.response.create()
            deltas = 0
            async for event in conn:
                resume.count += 1  # every server event: one WebSocket message
                if event.type == "response.output_text.delta":
                    print(event.delta, end="", flush=True)
                    deltas += 1
                    if turn == 0 and deltas == cut_after:
                        cut(conn)
                elif event.type == "error":
                    print(f"\n[error: {event.error.message}]", file=sys.stderr)
                    return 1
                elif event.type == "response.done":
                    print(f"\n[{event.response.status}; {deltas} deltas]")
                    break
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8080/v1", help="default: %(default)s")
    p.add_argument(
        "--model", default="wslb-reference", help="sent as ?model= (default: %(default)s)"
    )
    p.add_argument("--session", help="wslb's session key (default: wslb makes one)")
    p.add_argument("--cut-after", type=int, metavar="N", help="demo: cut after N deltas")
    p.add_argument("prompts", nargs="*")
    args = p.parse_args(argv)
    prompts = args.prompts or [line.strip() for line in sys.stdin if line.strip()]
    return asyncio.run(chat(args.base_url, args.model, args.session, prompts, args.cut_after))


if __name__ == "__main__":
    sys.exit(main())
