"""The official ``openai`` SDK through wslb: the Responses API's WebSocket mode in the terminal.

    pip install openai
    python examples/responses_client.py --session alice "hello there" "tell me more"

Each argument is one user turn (else one per line from stdin), sent as a ``response.create``
with only that input and the ``previous_response_id`` of the answer before, as agents do: the
worker holds the conversation, so nothing is sent twice. The answer streams as it comes
(``response.output_text.delta``). ``--session`` is wslb's session key (the SDK's
``extra_query``): the same key lands on the worker that holds the conversation, also after the
SDK's own reconnect. Without it, wslb makes one up and returns it in the 101's
``X-Session-Id``. ``--model`` goes in each ``response.create``; ``--route-model`` also sends it
as ``?model=``, which pools may match on.
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


async def chat(
    base_url: str, model: str, route: bool, session: str | None, prompts: Sequence[str]
) -> int:
    client = AsyncOpenAI(base_url=base_url, api_key="not-needed-by-wslb")
    query = {"session": session} if session else {}
    if route:
        query["model"] = model
    previous: str | None = None
    async with client.responses.connect(extra_query=query, on_reconnecting=on_reconnecting) as conn:
        for prompt in prompts:
            print(f"> {prompt}")
            if previous is None:
                await conn.response.create(model=model, input=prompt, store=False)
            else:
                await conn.response.create(
                    model=model, input=prompt, previous_response_id=previous, store=False
                )
            async for event in conn:
                if event.type == "response.output_text.delta":
                    print(event.delta, end="", flush=True)
                elif event.type == "error":
                    print(f"\n[error: {event.error.message}]", file=sys.stderr)
                    return 1
                elif event.type in ("response.completed", "response.incomplete"):
                    usage = event.response.usage
                    cached = usage.input_tokens_details.cached_tokens if usage else 0
                    print(f"\n[{event.response.status}; cached input tokens: {cached}]")
                    previous = event.response.id
                    break
                elif event.type == "response.failed":
                    error = event.response.error
                    print(f"\n[failed: {error.message if error else '?'}]", file=sys.stderr)
                    return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8080/v1", help="default: %(default)s")
    p.add_argument("--model", default="wslb-reference", help="default: %(default)s")
    p.add_argument("--route-model", action="store_true", help="also send the model as ?model=")
    p.add_argument("--session", help="wslb's session key (default: wslb makes one)")
    p.add_argument("prompts", nargs="*")
    args = p.parse_args(argv)
    prompts = args.prompts or [line.strip() for line in sys.stdin if line.strip()]
    return asyncio.run(chat(args.base_url, args.model, args.route_model, args.session, prompts))


if __name__ == "__main__":
    sys.exit(main())
