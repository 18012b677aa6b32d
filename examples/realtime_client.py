"""The official ``openai`` SDK through wslb: an OpenAI Realtime (text) conversation in the terminal.

    pip install openai
    python examples/realtime_client.py --session alice "hello there" "tell me more"

Each argument is one user turn (else one per line from stdin); the answer streams as it comes
(``response.output_text.delta``). ``--session`` is wslb's session key (the SDK's
``extra_query``): the same key lands on the worker that holds the conversation, and the SDK's
own reconnect (it retries after 1001, 1011, 1012, ...) brings it back there, so the conversation
goes on after a drain or a restart of wslb. Without it, wslb makes one up and returns it in the
101's ``X-Session-Id``. ``--model`` is sent as ``?model=``, which pools may match on.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from openai import AsyncOpenAI
from openai.types.websocket_reconnection import ReconnectingEvent, ReconnectingOverrides


def on_reconnecting(event: ReconnectingEvent) -> ReconnectingOverrides | None:
    print(
        f"\n[reconnecting after close {event.close_code}: attempt {event.attempt}]",
        file=sys.stderr,
    )
    return None  # the same query (session key): back to the worker holding the conversation


async def chat(base_url: str, model: str, session: str | None, prompts: Sequence[str]) -> int:
    client = AsyncOpenAI(base_url=base_url, api_key="not-needed-by-wslb")
    query = {"session": session} if session else {}
    async with client.realtime.connect(
        model=model, extra_query=query, on_reconnecting=on_reconnecting
    ) as conn:
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
        for prompt in prompts:
            print(f"> {prompt}")
            await conn.conversation.item.create(
                item={
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": prompt}],
                }
            )
            await conn.response.create()
            async for event in conn:
                if event.type == "response.output_text.delta":
                    print(event.delta, end="", flush=True)
                elif event.type == "error":
                    print(f"\n[error: {event.error.message}]", file=sys.stderr)
                    return 1
                elif event.type == "response.done":
                    usage = event.response.usage
                    details = usage.input_token_details if usage else None
                    cached = details.cached_tokens if details else 0
                    print(f"\n[{event.response.status}; cached input tokens: {cached}]")
                    break
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8080/v1", help="default: %(default)s")
    p.add_argument(
        "--model", default="wslb-reference", help="sent as ?model= (default: %(default)s)"
    )
    p.add_argument("--session", help="wslb's session key (default: wslb makes one)")
    p.add_argument("prompts", nargs="*")
    args = p.parse_args(argv)
    prompts = args.prompts or [line.strip() for line in sys.stdin if line.strip()]
    return asyncio.run(chat(args.base_url, args.model, args.session, prompts))


if __name__ == "__main__":
    sys.exit(main())
