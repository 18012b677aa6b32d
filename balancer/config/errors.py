"""How a config problem is told: :class:`ConfigError`, YAML paths, and the JSON Schema pass.

Every problem is a ``(path, message)`` pair until the end, when :func:`_render` names each by its
YAML path (``pools[0].backends[1].url``) and sorts them in file order. The schema pass turns each
jsonschema error into a message an operator can act on, at the path of the mistake, rather than
jsonschema's own wording. This is the bottom of the package: it imports nothing from it, and the
shared wording of unit errors lives here so the schema pass and the parsers describe a bad value
alike.
"""

from __future__ import annotations

import difflib
import errno
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from functools import cache
from importlib import resources
from typing import Any, Final

import jsonschema

from balancer.weights import PRESETS

__all__ = ["ConfigError", "ListenError"]


class ListenError(OSError):
    """wslb could not listen on one of its addresses; the message names the config key."""

    def __init__(self, key: str, address: str, err: OSError, default: bool = False) -> None:
        """``key``: ``listen``, ``admin.listen`` or ``metrics.listen``; ``default``: the file
        does not set it, so the operator may not know wslb wanted that port."""
        port = address.rsplit(":", 1)[-1]
        where = f"{key} {address}"
        if default:
            where += f" (the default: the config sets no {key})"
        if err.errno == errno.EADDRINUSE:
            why = (
                "address already in use: another process listens there, another wslb perhaps "
                f"(`ss -ltnp 'sport = :{port}'` names it); stop it or set {key} to a free port"
            )
        elif err.errno == errno.EACCES:
            why = f"permission denied (ports below 1024 need privileges); set {key} to another"
        elif err.errno == errno.EADDRNOTAVAIL:
            why = f"no interface of this machine has that address; fix {key}"
        else:
            why = err.strerror or str(err)
        super().__init__(err.errno, f"{where}: {why}")
        self.key = key

    def __str__(self) -> str:
        return str(self.strerror)


class ConfigError(Exception):
    """Every problem found in a config, each ``"PATH: message"`` (``pools[0].backends[1].url``).

    All problems travel together so an operator fixes a file in one pass; ``str()`` is one
    problem per line, ready for ``wslb check`` to print.
    """

    errors: list[str]
    source: str

    def __init__(self, errors: Iterable[str] | str, source: str = "<config>") -> None:
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        self.source = source
        super().__init__("\n".join(self.errors))

    def __str__(self) -> str:
        return "\n".join(self.errors)

    def __reduce__(self) -> tuple[type[ConfigError], tuple[list[str], str]]:
        # The default would rebuild from the joined message and split it into characters.
        return (type(self), (self.errors, self.source))


# Shared by the schema pass and units.parse_duration / parse_size, so both word a bad value alike.
_DURATION_HINT: Final = "a number of seconds, or 250ms, 1.5s, 2m, 1h"
_SIZE_HINT: Final = "a number of bytes, or 256KiB, 16MiB, 1GiB, 1KB, 1MB"


# --------------------------------------------------------------------------- error paths

_Path = tuple[object, ...]  # mapping keys and list indexes, outermost first
_Problem = tuple[_Path, str]
_IDENT: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def _format_path(path: _Path, source: str) -> str:
    """``pools[0].backends[1].url``; the empty path (the whole file) is ``source``."""
    if not path:
        return source
    out: list[str] = []
    for part in path:
        if isinstance(part, int) and not isinstance(part, bool):
            out.append(f"[{part}]")
        elif isinstance(part, str) and _IDENT.fullmatch(part):
            out.append(f".{part}" if out else part)
        else:
            out.append(f"[{_show(part)}]")
    return "".join(out)


def _show(v: object) -> str:
    """A value as the YAML author would recognise it, kept short."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, list):
        return "a list"
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _render(problems: list[_Problem], data: object, source: str) -> list[str]:
    """Format, de-duplicate and sort problems in the order their paths appear in the file."""
    ordered = sorted(problems, key=lambda p: _file_order(data, p[0]))
    out: dict[str, None] = {}
    for path, message in ordered:
        out.setdefault(f"{_format_path(path, source)}: {message}", None)
    return list(out)


def _file_order(data: object, path: _Path) -> tuple[int, ...]:
    order: list[int] = []
    node = data
    for part in path:
        if isinstance(node, dict):
            keys = list(node)
            order.append(keys.index(part) if part in node else len(keys))
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            order.append(part)
            node = node[part]
        else:
            order.append(0)
            node = None
    return tuple(order)


_MAX_DEPTH: Final = 64
_MAX_NODES: Final = 200_000


def _prepare(data: object) -> tuple[object, list[_Problem], list[_Problem]]:
    """Copy ``data`` for validation: returns (copy, fatal problems, key problems).

    Fatal: data no config has and YAML aliases can produce (very deep, self-referencing, huge);
    parsing stops there, before the schema validator could recurse forever or take minutes.
    Keys that are not text (YAML reads ``on:`` as ``true:``) are reported and left out of the
    copy, as jsonschema assumes text keys.
    """
    fatal: list[_Problem] = []
    keys: list[_Problem] = []
    nodes = 0
    on_path: set[int] = set()

    def copy(v: object, path: _Path) -> object:
        nonlocal nodes
        nodes += 1
        if fatal or nodes > _MAX_NODES:
            return None
        if len(path) > _MAX_DEPTH:
            fatal.append((path, f"nested deeper than {_MAX_DEPTH} levels"))
            return None
        if isinstance(v, int) and v.bit_length() > 256:
            fatal.append((path, "number too large"))
        if not isinstance(v, dict | list):
            return v
        if id(v) in on_path:
            fatal.append((path, "refers to itself (recursive YAML alias)"))
            return None
        on_path.add(id(v))
        out: object
        if isinstance(v, list):
            out = [copy(child, (*path, i)) for i, child in enumerate(v)]
        else:
            mapping: dict[str, object] = {}
            for k, child in v.items():
                if isinstance(k, str):
                    mapping[k] = copy(child, (*path, k))
                else:
                    keys.append(((*path, k), "key is not text (quote it in YAML)"))
            out = mapping
        on_path.discard(id(v))
        return out

    result = copy(data, ())
    if nodes > _MAX_NODES and not fatal:
        fatal.append(((), f"more than {_MAX_NODES} values (YAML alias expansion?)"))
    return result, fatal, keys


# --------------------------------------------------------------------------- schema pass

_SCHEMA_RESOURCE: Final = "schema/balancer.schema.json"


@cache
def _validator() -> jsonschema.Draft202012Validator:
    text = resources.files("balancer").joinpath(_SCHEMA_RESOURCE).read_text(encoding="utf-8")
    return jsonschema.Draft202012Validator(json.loads(text))


_JSON_TYPES: Final = {
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "true or false",
    "object": "a mapping",
    "array": "a list",
    "null": "null",
}
_PRESETS: Final = tuple(PRESETS)  # the names balancer.weights resolves
# Messages for schema patterns, by the "title" of the schema holding the pattern.
_PATTERN_MESSAGES: Final = {
    "duration": f"is not a duration ({_DURATION_HINT})",
    "size": f"is not a size ({_SIZE_HINT})",
    "address": "is not host:port (e.g. 127.0.0.1:8080, [::1]:8080, :8080)",
    "name": "is not a valid name (letters, digits, '.', '_', '-'; starting with a letter or digit)",
    "url path": "must start with '/'",
    "cidr": "is not an IP address or CIDR block",
    "http url": "is not an http:// or https:// URL",
    "backend url": "is not a ws://, wss://, http:// or https:// URL",
    "session key": "is not a session key source (query:NAME, header:NAME, cookie:NAME or path:N)",
    "metric name": "is not a Prometheus metric name",
    "metrics preset": f"is not a metrics preset ({', '.join(_PRESETS)})",
    "origin": "is not an origin (scheme://host[:port], no path)",
}
_TYPE_HINTS: Final = {"duration": _DURATION_HINT, "size": _SIZE_HINT}


def _schema_problems(data: object) -> list[_Problem]:
    out: list[_Problem] = []
    for error in _validator().iter_errors(data):
        out.extend(_translate(error))
    return out


def _translate(error: jsonschema.ValidationError) -> Iterator[_Problem]:
    """One jsonschema error as problems an operator can act on, at the path of the mistake."""
    path: _Path = tuple(error.absolute_path)
    keyword = error.validator
    expected: Any = error.validator_value
    value: Any = error.instance
    schema: Mapping[str, Any] = error.schema if isinstance(error.schema, Mapping) else {}
    title = schema.get("title")
    if keyword == "additionalProperties" and isinstance(value, dict):
        allowed = list(schema.get("properties", {}))
        patterns = list(schema.get("patternProperties", {}))
        for key in value:
            if key in allowed or (
                isinstance(key, str) and any(re.search(r, key) for r in patterns)
            ):
                continue
            yield (*path, key), _unknown_key(key, allowed)
    elif keyword == "required" and isinstance(value, dict):
        for key in expected:
            if key not in value:
                yield (*path, key), "required key is missing"
    elif keyword == "type":
        types = [expected] if isinstance(expected, str) else list(expected)
        wanted = _or([_JSON_TYPES.get(t, t) for t in types])
        if title in _TYPE_HINTS:
            wanted = f"a {title} ({_TYPE_HINTS[title]})"
        yield path, f"expected {wanted}, got {_show(value)}"
    elif keyword == "pattern":
        message = _PATTERN_MESSAGES.get(title or "", f"does not match {expected!r}")
        if title == "metrics preset":
            message += _suggest(value, _PRESETS)
        yield path, f"{_show(value)} {message}"
    elif keyword == "enum":
        if title == "jwt algorithm" and isinstance(value, str) and value.lower() == "none":
            yield path, "'none' is not allowed: tokens must be signed"
        else:
            choices = ", ".join(_show(c) for c in expected)
            yield path, f"{_show(value)} is not one of {choices}{_suggest(value, expected)}"
    elif keyword == "minimum" and expected == 0:
        yield path, f"must not be negative, got {_show(value)}"
    elif keyword in _BOUNDS:
        yield path, f"must be {_BOUNDS[keyword]} {expected}, got {_show(value)}"
    elif keyword in ("minLength", "minItems", "minProperties") and expected == 1:
        yield path, "must not be empty"
    elif keyword == "uniqueItems" and isinstance(value, list):
        seen: list[object] = []
        repeated: object = "an entry"
        for item in value:
            if item in seen:
                repeated = _show(item)
                break
            seen.append(item)
        yield path, f"lists {repeated} more than once"
    elif keyword in ("anyOf", "oneOf") and error.context:
        yield from _translate(jsonschema.exceptions.best_match(error.context))
    else:
        yield path, error.message


_BOUNDS: Final = {
    "minimum": "at least",
    "maximum": "at most",
    "exclusiveMinimum": "greater than",
    "exclusiveMaximum": "less than",
}


def _or(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _suggest(value: object, choices: Iterable[object]) -> str:
    if not isinstance(value, str):
        return ""
    names = [c for c in choices if isinstance(c, str)]
    close = difflib.get_close_matches(value, names, n=1, cutoff=0.6)
    if not close and len(value) >= 3:  # a prefix: "gpu" for "gpu_util"
        close = [c for c in names if c.lower().startswith(value.lower())][:1]
    return f" (did you mean {close[0]!r}?)" if close else ""


def _unknown_key(key: object, allowed: list[str]) -> str:
    hint = _suggest(str(key), allowed)
    if hint:
        return "unknown key" + hint
    return "unknown key; expected one of " + ", ".join(allowed) if allowed else "unknown key"
