"""Log set-up (text or JSON lines) and the access log: one line per ended session.

The access log is what operators grep first, as HAProxy's one line per session is: who (client
address, session key), where (pool, the worker or workers a migration moved it over), how long,
how much each way (data messages and bytes), how it closed on each side and why it ended. It goes
to the ``wslb.access`` logger at INFO; ``log.access: false`` turns it off.

Text, ``key=value`` with values quoted only when they need it::

    127.0.0.1 session=alice pool=chat backend=w1 path=/ws status=101 connect=0.3ms
    upgrade=1.2ms duration=12.304s msgs_in=3 msgs_out=120 bytes_in=310 bytes_out=9021
    close_client=1000 close_worker=1000 migrations=0 failovers=0 end="client closed"
    ua=Python/3.11

(one line). A plain HTTP request (``aio/httpproxy.py``) has a line of its own, with its method
and the time to the worker's response head::

    127.0.0.1 POST /v1/chat/completions status=200 session=alice pool=chat backend=w1
    kind=sse connect=0.2ms headers=3.1ms duration=1.204s bytes_in=310 bytes_out=9021
    end=done ua=OpenAI/Python

With ``log.format: json`` every log line is one JSON object (``ts``, ``level``,
``logger``, ``message``), and an access line carries its fields as keys of that object. Times
are ISO 8601 with milliseconds and the zone in both formats; the workers wslb spawns log in its
format too (``WSLB_LOG_FORMAT``).
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import math
import os
import re
import time
from collections.abc import Mapping
from typing import Any, Final, Protocol

__all__ = [
    "ACCESS",
    "JsonFormatter",
    "access_fields",
    "access_line",
    "access_sink",
    "access_text",
    "count",
    "http_access_text",
    "log_http_access",
    "setup",
]

ACCESS = logging.getLogger("wslb.access")


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and the noun in the number it needs: "1 session", "2 sessions", "0 sessions"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMAT_ENV = "WSLB_LOG_FORMAT"
"""Given to the processes wslb starts (spawned workers) so that their lines match its own."""


def iso_time(created: float) -> str:
    """A record's time as ISO 8601 with milliseconds and the zone (``2026-12-01T21:19:25.064
    +00:00``): what log shippers parse without configuration, unambiguous across zones.

    ``datetime.fromtimestamp(created).astimezone().isoformat(timespec="milliseconds")``, with
    the date, time and zone of each second made once (a batch of access lines shares them):
    the microseconds rounded half to even as ``fromtimestamp`` rounds them, then cut to ms."""
    frac, whole = math.modf(created)
    us = round(frac * 1e6)
    if us >= 1_000_000:
        whole, us = whole + 1, us - 1_000_000
    elif us < 0:  # before 1970
        whole, us = whole - 1, us + 1_000_000
    head, zone = _second(int(whole))
    return f"{head}.{us // 1000:03d}{zone}"


@functools.lru_cache(maxsize=8)
def _second(whole: int) -> tuple[str, str]:
    """``YYYY-MM-DDTHH:MM:SS`` and the zone (``+00:00``) of one second."""
    text = datetime.datetime.fromtimestamp(whole).astimezone().isoformat()
    return text[:19], text[19:]


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT`` with ISO 8601 timestamps (``iso_time``); ``tag`` (``[w1]``) follows
    the logger's name."""

    def __init__(self, tag: str = "") -> None:
        super().__init__(TEXT_FORMAT.replace("%(name)s", f"%(name)s{tag}"))
        self.tag = tag

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return iso_time(record.created)


_PLAIN = re.compile(r"[A-Za-z0-9._:/@,+=\[\]-]+")


class JsonFormatter(logging.Formatter):
    """One JSON object per record; ``extra={"fields": {...}}`` adds keys (the access log)."""

    def __init__(self, process: str | None = None) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": iso_time(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.process is not None:
            out["process"] = self.process
        fields = getattr(record, "fields", None)
        if isinstance(fields, Mapping):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"), default=str)


def _not_closed_tls(record: logging.LogRecord) -> bool:
    """Drop uvloop's ``SSL connection is closed`` warning: it comes when a session writes to a
    client whose TLS has just ended (its close is under way, the session learns of it a turn
    later), which is the client's leaving, not a fault to wake an operator for."""
    return record.getMessage() != "SSL connection is closed"


def setup(level: int, fmt: str = "text", process: str | None = None) -> None:
    """Configure the root logger once the config names the format (``log.format``).

    ``process`` tags the lines of one serving process of ``workers: N``.
    """
    root = logging.getLogger()
    handler = root.handlers[0] if root.handlers else logging.StreamHandler()
    if not root.handlers:
        root.addHandler(handler)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(process))
    else:
        handler.setFormatter(TextFormatter(f"[{process}]" if process is not None else ""))
    root.setLevel(level)
    asyncio_log = logging.getLogger("asyncio")
    if _not_closed_tls not in asyncio_log.filters:
        asyncio_log.addFilter(_not_closed_tls)
    os.environ[FORMAT_ENV] = fmt  # what the workers wslb spawns log in


class EndedSession(Protocol):
    """What the access log reads of a finished session (``aio/server.py``'s ``Session``)."""

    sid: str
    peer: str
    started_wall: float

    @property
    def pool_name(self) -> str: ...

    @property
    def backends(self) -> tuple[str, ...]: ...

    @property
    def totals(self) -> tuple[int, int, int, int]: ...

    @property
    def close_to_client(self) -> int | None: ...

    @property
    def close_to_worker(self) -> int | None: ...

    @property
    def migrations(self) -> int: ...

    @property
    def failovers(self) -> int: ...

    @property
    def resumes(self) -> int: ...

    @property
    def ended(self) -> str | None: ...

    timing: tuple[float, float]
    """Seconds the first worker leg took: its TCP (and TLS) connect, then its answer (101)."""

    @property
    def path(self) -> str: ...

    @property
    def user_agent(self) -> str | None: ...


def access_fields(s: EndedSession, now: float | None = None) -> dict[str, Any]:
    """The access-log fields of a session that has just ended."""
    msgs_in, msgs_out, bytes_in, bytes_out = s.totals
    end = time.time() if now is None else now
    connect, answer = s.timing
    return {
        "client": s.peer,
        "session": s.sid,
        "pool": s.pool_name,
        "backends": list(s.backends),
        "path": s.path,
        "status": 101,
        "user_agent": s.user_agent,
        "connect_ms": round(connect * 1000, 1),
        "upgrade_ms": round(answer * 1000, 1),
        "duration_s": round(max(0.0, end - s.started_wall), 3),
        "messages_in": msgs_in,
        "messages_out": msgs_out,
        "bytes_in": bytes_in,
        "bytes_out": bytes_out,
        "close_to_client": s.close_to_client,
        "close_to_worker": s.close_to_worker,
        "migrations": s.migrations,
        "failovers": s.failovers,
        "resumes": s.resumes,
        "end": s.ended or "closed",
    }


def _quote(value: object) -> str:
    """A field as the access line writes it: bare when plain, else a JSON string."""
    text = "-" if value is None else str(value)
    return _quote_short(text) if len(text) <= QUOTE_CACHED else _quoted(text)


def _quoted(text: str) -> str:
    return text if _PLAIN.fullmatch(text) else json.dumps(text)


QUOTE_CACHED: Final = 128
"""Fields up to this long are quoted once (``_quote_short``): a batch of lines repeats its
clients, keys, pools, methods and paths. A longer one, which a client can make as long as a
request head, is quoted each time, so the cache stays under a megabyte."""
_quote_short = functools.lru_cache(maxsize=1024)(_quoted)


def access_text(f: Mapping[str, Any]) -> str:
    """The text form of ``access_fields`` (module docstring)."""
    return (
        f"{_quote(f['client'])} session={_quote(f['session'])} pool={_quote(f['pool'])} "
        f"backend={_quote(','.join(f['backends']))} path={_quote(f['path'])} "
        f"status={f['status']} connect={f['connect_ms']}ms upgrade={f['upgrade_ms']}ms "
        f"duration={f['duration_s']:.3f}s "
        f"msgs_in={f['messages_in']} msgs_out={f['messages_out']} "
        f"bytes_in={f['bytes_in']} bytes_out={f['bytes_out']} "
        f"close_client={_quote(f['close_to_client'])} close_worker={_quote(f['close_to_worker'])} "
        f"migrations={f['migrations']} failovers={f['failovers']} "
        + (f"resumes={f['resumes']} " if f.get("resumes") else "")  # only where it happened
        + f"end={_quote(f['end'])} ua={_quote(f['user_agent'])}"
    )


def log_access(s: EndedSession) -> None:
    """Write the access line of a session that has just ended."""
    if ACCESS.isEnabledFor(logging.INFO):
        fields = access_fields(s)
        ACCESS.info(access_text(fields), extra={"fields": fields})


def http_access_text(f: Mapping[str, Any]) -> str:
    """The text form of a plain HTTP request's access fields (module docstring)."""
    return (
        f"{_quote(f['client'])} {_quote(f['method'])} {_quote(f['path'])} status={f['status']} "
        f"session={_quote(f['session'])} pool={_quote(f['pool'])} "
        f"backend={_quote(f['backend'])} kind={f['kind']} connect={f['connect_ms']}ms "
        f"headers={f['headers_ms']}ms duration={f['duration_s']:.3f}s "
        f"bytes_in={f['bytes_in']} bytes_out={f['bytes_out']} end={_quote(f['end'])} "
        f"ua={_quote(f['user_agent'])}"
    )


def access_sink() -> tuple[str, str, logging.StreamHandler[Any] | None] | None:
    """Where the lanes (``aio/lanes.py``) may write their batches of access lines, formatted
    by this module's formatter: ``("off", "", None)`` when the access logger is off, ``("text" |
    "json", tag, handler)`` when its lines go to one plain stream handler with one of this
    module's formatters and nothing filters them; None otherwise (another handler, a filter,
    pytest's capture): each line must then go through ``log_http_access``."""
    if not ACCESS.isEnabledFor(logging.INFO):
        return ("off", "", None)
    root = logging.getLogger()
    if ACCESS.handlers or ACCESS.filters or not ACCESS.propagate or root.filters:
        return None
    if len(root.handlers) != 1:
        return None
    handler = root.handlers[0]
    if type(handler) is not logging.StreamHandler or handler.filters:
        return None
    if handler.level > logging.INFO:
        return ("off", "", None)
    form = handler.formatter
    if type(form) is JsonFormatter:
        return ("json", form.process or "", handler)
    if type(form) is TextFormatter:
        return ("text", form.tag, handler)
    return None


def access_line(formatter: logging.Formatter, created: float, fields: Mapping[str, Any]) -> str:
    """What ``formatter`` (this module's, as ``access_sink`` found it) makes of the access line
    of a plain HTTP request that ended at ``created``, without a LogRecord: the lanes write
    theirs in batches (``aio/lanes.py``)."""
    text = http_access_text(fields)
    if isinstance(formatter, JsonFormatter):
        out: dict[str, Any] = {
            "ts": iso_time(created),
            "level": "info",
            "logger": ACCESS.name,
            "message": text,
        }
        if formatter.process is not None:
            out["process"] = formatter.process
        out.update(fields)
        return json.dumps(out, separators=(",", ":"), default=str)
    tag = formatter.tag if isinstance(formatter, TextFormatter) else ""
    return f"{iso_time(created)} {_access_head(tag)}{text}"


@functools.lru_cache(maxsize=8)
def _access_head(tag: str) -> str:
    """What ``TEXT_FORMAT`` puts between an access line's time and its message."""
    line = TEXT_FORMAT.replace("%(name)s", f"%(name)s{tag}") % {
        "asctime": "",
        "levelname": "INFO",
        "name": ACCESS.name,
        "message": "",
    }
    return line[1:]


def log_http_access(fields: Mapping[str, Any]) -> None:
    """Write the access line of a plain HTTP request that has just ended."""
    if ACCESS.isEnabledFor(logging.INFO):
        ACCESS.info(http_access_text(fields), extra={"fields": dict(fields)})
