"""The referees the C modules are compared with: llhttp (through httptools) and h11, parsers
nobody here wrote. Each takes the bytes a peer sent and says what a conforming HTTP/1.1 parser
makes of them: the messages it completed, the one it was in when the bytes ended, and the error
that stopped it, if any.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import h11
import httptools


@dataclass
class Message:
    """One HTTP message as a referee parsed it."""

    method: bytes = b""  # a request's
    target: bytes = b""
    status: int = 0  # a response's
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)  # names lowercased
    body: bytes = b""
    head_done: bool = False
    complete: bool = False


@dataclass
class Parsed:
    """What a referee made of a byte stream: its messages in order (the last one possibly not
    complete) and the error that stopped it (None: every byte was taken)."""

    messages: list[Message]
    error: str | None

    def complete(self) -> list[Message]:
        return [m for m in self.messages if m.complete]


class _Events:
    """httptools' callbacks into Messages."""

    def __init__(self, parser_of: list[httptools.HttpRequestParser | httptools.HttpResponseParser]):
        self.parser_of = parser_of
        self.messages: list[Message] = []
        self._body = bytearray()

    def on_message_begin(self) -> None:
        self.messages.append(Message())
        self._body = bytearray()

    def on_url(self, url: bytes) -> None:
        self.messages[-1].target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.messages[-1].headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        m = self.messages[-1]
        m.head_done = True
        parser = self.parser_of[0]
        if isinstance(parser, httptools.HttpRequestParser):
            m.method = parser.get_method()
        else:
            m.status = parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self._body += body
        self.messages[-1].body = bytes(self._body)

    def on_message_complete(self) -> None:
        self.messages[-1].complete = True


def llhttp(data: bytes, response: bool = False) -> Parsed:
    """llhttp's reading of ``data`` (requests, or responses to GET requests)."""
    holder: list[httptools.HttpRequestParser | httptools.HttpResponseParser] = []
    events = _Events(holder)
    parser = (
        httptools.HttpResponseParser(events) if response else httptools.HttpRequestParser(events)
    )
    holder.append(parser)
    try:
        parser.feed_data(data)
    except httptools.HttpParserUpgrade:
        return Parsed(events.messages, "upgrade")
    except httptools.HttpParserError as exc:
        return Parsed(events.messages, f"{type(exc).__name__}: {exc}")
    return Parsed(events.messages, None)


def h11_requests(data: bytes, eof: bool = True) -> Parsed:
    """h11's reading of ``data`` as a server (each request answered, so the next is read);
    ``eof``: the bytes end with the client's EOF."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    if eof:
        conn.receive_data(b"")
    out: list[Message] = []
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            return Parsed(out, f"h11: {exc}")
        if event is h11.NEED_DATA or event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
            return Parsed(out, None)
        if isinstance(event, h11.Request):
            out.append(
                Message(
                    method=bytes(event.method),
                    target=bytes(event.target),
                    headers=[(bytes(n), bytes(v)) for n, v in event.headers.raw_items()],
                    head_done=True,
                )
            )
            out[-1].headers = [(n.lower(), v) for n, v in out[-1].headers]
        elif isinstance(event, h11.Data):
            out[-1].body += bytes(event.data)
        elif isinstance(event, h11.EndOfMessage):
            out[-1].complete = True
            if conn.our_state is h11.SEND_RESPONSE:
                conn.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
                conn.send(h11.EndOfMessage())
            if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                conn.start_next_cycle()
            else:
                return Parsed(out, None)


def h11_response(data: bytes, eof: bool = True) -> Parsed:
    """h11's reading of ``data`` as the answer to ``GET /``: its final response (1xx skipped)."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("host", "h")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(data)
    if eof:
        conn.receive_data(b"")
    out: list[Message] = []
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            return Parsed(out, f"h11: {exc}")
        if isinstance(event, h11.Response):
            out.append(
                Message(
                    status=event.status_code,
                    headers=[(bytes(n).lower(), bytes(v)) for n, v in event.headers.raw_items()],
                    head_done=True,
                )
            )
        elif isinstance(event, h11.Data):
            out[-1].body += bytes(event.data)
        elif isinstance(event, h11.EndOfMessage):
            out[-1].complete = True
            return Parsed(out, None)
        elif isinstance(event, h11.InformationalResponse):
            continue
        else:  # NEED_DATA, PAUSED, ConnectionClosed
            return Parsed(out, None)


def final_response(parsed: Parsed) -> Message | None:
    """The first response that is not a 1xx, if its head was read."""
    for m in parsed.messages:
        if m.head_done and m.status >= 200:
            return m
        if not m.head_done:
            return None
    return None


def close_delimited(m: Message) -> bool:
    """A response whose body ends at the connection's end (no length, not chunked)."""
    names = {n for n, _ in m.headers}
    return m.status not in (204, 304) and not names & {b"content-length", b"transfer-encoding"}
