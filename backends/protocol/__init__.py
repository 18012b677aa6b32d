"""Client protocols served beside the chat protocol, as sans-I/O state machines.

Each module here maps one wire protocol onto the worker's session state (``backends.model``)
without sockets, clocks or asyncio, so the reference worker and the engine bridge share it and
it is tested without a network: ``realtime`` is the OpenAI Realtime protocol (text modality),
``responses`` the Responses API's WebSocket mode, ``openai_http`` what the OpenAI HTTP routes read
and write (Chat Completions, the Responses body as a ``response.create``, the error shape).
"""
