"""A benchmark script's plumbing: SIGTERM as Ctrl-C (so its cleanup kills what it started),
modules checked before a long run, the arguments of a run with ``--quick`` and ``--parts``, a
list-of-sizes argument, the open-files limit, progress on stderr."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import resource
import sys
from collections.abc import Mapping, Sequence
from types import FrameType

__all__ = [
    "log",
    "parse_args_quick",
    "parse_sizes",
    "raise_nofile",
    "require_modules",
    "sigterm_as_interrupt",
]


def require_modules(names: Sequence[str], why: str) -> None:
    """Stop before a long run, not after it, when a module it will need is missing."""

    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if missing:
        raise SystemExit(
            f"{why} needs {', '.join(missing)}: pip install -e '.[bench]' (or without {why})"
        )


def sigterm_as_interrupt(signum: int, frame: FrameType | None) -> None:
    """A SIGTERM handler (``signal.signal(signal.SIGTERM, sigterm_as_interrupt)``): the script
    stops as on Ctrl-C, so its cleanup kills what it started."""
    raise KeyboardInterrupt


def parse_sizes(text: str) -> list[int]:
    """``N`` or ``N,N,...`` (session counts of a sweep), each at least 1: an argparse type."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N,N,...: {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("session counts must be at least 1")
    return sizes


def raise_nofile(want: int | None = None) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE (children inherit it) to ``want``, by default to the hard
    limit (65536 where that is unlimited), and the hard limit with it where this process may
    (CAP_SYS_RESOURCE); else as far as the hard limit goes. The limits after, (soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = hard == resource.RLIM_INFINITY
    if want is None:
        want = max(soft, 65536) if infinite else hard
    if want > soft:
        new_hard = hard if infinite or hard >= want else want
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, new_hard))
        except (ValueError, OSError):
            if not infinite:
                with contextlib.suppress(ValueError, OSError):
                    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def log(msg: str) -> None:
    """A progress line on stderr: stdout is the report."""
    print(msg, file=sys.stderr, flush=True)


def parse_args_quick(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    quick: Mapping[str, object],
    parts: Sequence[str],
) -> tuple[argparse.Namespace, list[str]]:
    """A benchmark's arguments: with ``--quick``, its ``quick`` values wherever the command
    line kept a default; and the ``--parts`` it names, each one of ``parts``."""
    args = parser.parse_args(argv)
    if args.quick:  # the quick values, except where the command line names one
        for k, v in quick.items():
            if getattr(args, k) == parser.get_default(k):
                setattr(args, k, v)
    chosen = [x.strip() for x in args.parts.split(",") if x.strip()]
    if not chosen or not set(chosen) <= set(parts):
        raise SystemExit(f"--parts: {', '.join(parts)}")
    return args, chosen
