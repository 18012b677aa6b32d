"""The value syntax of balancer.yaml: ``${VAR}`` expansion, durations and sizes.

These work on single values or on the raw text, outside any structure: :func:`expand_env` runs
before YAML parsing, and the admin API parses request durations with :func:`parse_duration`.
The JSON Schema's ``duration`` and ``size`` patterns are :data:`DURATION_PATTERN` and
:data:`SIZE_PATTERN`, anchored (a test keeps them equal).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Final

from balancer.config.errors import _DURATION_HINT, _SIZE_HINT, ConfigError

__all__ = ["DURATION_PATTERN", "SIZE_PATTERN", "expand_env", "parse_duration", "parse_size"]


# --------------------------------------------------------------------------- environment

_ENV_EXPR: Final = re.compile(
    r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-|:\?|\?)(?P<arg>.*))?", re.DOTALL
)


def expand_env(text: str, env: Mapping[str, str]) -> str:
    """Expand ``${VAR}`` references the way docker compose does, so secrets stay out of the file.

    ``${VAR}`` is the value or "" when unset; ``${VAR:-default}`` uses the default when VAR is
    unset or empty (``${VAR-default}``: only when unset); ``${VAR:?message}`` is an error when VAR
    is unset or empty (``${VAR?message}``: only when unset). Defaults may contain further
    ``${...}``. ``$$`` is a literal ``$``; any other ``$`` is kept as is. Values are inserted
    verbatim, before YAML parsing: quote a substitution whose value may contain YAML syntax.

    Raises:
        ConfigError: for malformed or required-but-unset substitutions, each named
            ``line L column C``.
    """
    errors: list[str] = []
    out = _expand(text, 0, text, env, errors)
    if errors:
        raise ConfigError(errors)
    return out


def _expand(s: str, base: int, whole: str, env: Mapping[str, str], errors: list[str]) -> str:
    parts: list[str] = []
    i = 0
    while (j := s.find("$", i)) >= 0:
        parts.append(s[i:j])
        if s.startswith("$$", j):
            parts.append("$")
            i = j + 2
        elif s.startswith("${", j):
            end = _closing_brace(s, j + 2)
            if end < 0:
                errors.append(f"{_line_col(whole, base + j)}: '${{' without a closing '}}'")
                parts.append(s[j:])
                return "".join(parts)
            parts.append(_substitute(s[j + 2 : end], base + j, whole, env, errors))
            i = end + 1
        else:
            parts.append("$")
            i = j + 1
    parts.append(s[i:])
    return "".join(parts)


def _closing_brace(s: str, start: int) -> int:
    depth = 0
    k = start
    while k < len(s):
        if s.startswith("$$", k):
            k += 2
            continue
        if s.startswith("${", k):
            depth += 1
            k += 2
            continue
        if s[k] == "}":
            if depth == 0:
                return k
            depth -= 1
        k += 1
    return -1


def _substitute(body: str, at: int, whole: str, env: Mapping[str, str], errors: list[str]) -> str:
    m = _ENV_EXPR.fullmatch(body)
    if m is None:
        errors.append(
            f"{_line_col(whole, at)}: invalid substitution '${{{body}}}' "
            "(expected ${NAME}, ${NAME:-default} or ${NAME:?message})"
        )
        return ""
    name, op, arg = m["name"], m["op"], m["arg"]
    value = env.get(name)
    if op is None:
        return value or ""
    unset = value is None if op in ("-", "?") else not value
    if op in (":-", "-"):
        if unset or value is None:
            return _expand(arg, at + 2 + m.start("arg"), whole, env, errors)
        return value
    if unset or value is None:
        errors.append(f"{_line_col(whole, at)}: {name} is not set" + (f": {arg}" if arg else ""))
        return ""
    return value


def _line_col(text: str, offset: int) -> str:
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return f"line {line} column {column}"


# --------------------------------------------------------------------------- units

# The JSON Schema's duration and size patterns are these, anchored (a test keeps them equal).
DURATION_PATTERN: Final = r"\s*([0-9]+(\.[0-9]+)?)\s*(ms|s|m|h)?\s*"
SIZE_PATTERN: Final = r"\s*([0-9]+(\.[0-9]+)?)\s*(B|KB|kB|MB|GB|KiB|MiB|GiB)?\s*"
_DURATION_RE: Final = re.compile(DURATION_PATTERN)
_SIZE_RE: Final = re.compile(SIZE_PATTERN)
_SECONDS: Final = {"ms": Decimal("0.001"), "s": Decimal(1), "m": Decimal(60), "h": Decimal(3600)}
_BYTES: Final = {
    "B": 1,
    "KB": 1000,
    "kB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
}


def parse_duration(v: str | int | float) -> float:
    """Seconds from ``"250ms"``, ``"1.5s"``, ``"2m"``, ``"1h"`` or a plain number of seconds.

    Units keep configs readable (``idle: 1h``); plain numbers keep them scriptable. Also used for
    durations in admin API requests.

    Raises:
        ValueError: not a duration, negative, or not finite.
    """
    if isinstance(v, str):
        m = _DURATION_RE.fullmatch(v)
        if m is None:
            raise ValueError(f"{v!r} is not a duration ({_DURATION_HINT})")
        seconds = float(Decimal(m[1]) * _SECONDS[m[3] or "s"])
    elif isinstance(v, int | float) and not isinstance(v, bool):
        try:
            seconds = float(v)
        except OverflowError:
            raise ValueError(f"{v!r} is too large for a duration") from None
    else:
        raise ValueError(f"{v!r} is not a duration ({_DURATION_HINT})")
    if not math.isfinite(seconds):
        raise ValueError(f"{v!r} is too large for a duration")
    if seconds < 0:
        raise ValueError(f"{v!r} is negative")
    return seconds


def parse_size(v: str | int | float) -> int:
    """Bytes from ``"256KiB"``, ``"16MiB"``, ``"1GiB"``, ``"1KB"`` (1000), ``"10B"`` or an int.

    Binary (KiB) and decimal (KB) units are both accepted because operators copy limits from both
    worlds; anything vaguer ("10k", "1M") is refused rather than guessed.

    Raises:
        ValueError: not a size, negative, or not a whole number of bytes.
    """
    if isinstance(v, str):
        m = _SIZE_RE.fullmatch(v)
        if m is None:
            raise ValueError(f"{v!r} is not a size ({_SIZE_HINT})")
        exact = Decimal(m[1]) * _BYTES[m[3] or "B"]
        if exact != exact.to_integral_value():
            raise ValueError(f"{v!r} is not a whole number of bytes")
        return int(exact)
    # JSON Schema counts 1024.0 as an integer, so YAML/JSON floats with no fraction are accepted.
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, int) and not isinstance(v, bool):
        if v < 0:
            raise ValueError(f"{v!r} is negative")
        return v
    raise ValueError(f"{v!r} is not a size ({_SIZE_HINT})")
