"""Command line: ``wslb --config F``, ``wslb check --config F``, ``wslb ctl ...``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from balancer import config as configmod
from balancer import logs
from balancer.version import version

__all__ = ["main"]


def _run(path: str, take_over: str | None = None) -> int:
    try:
        cfg = configmod.load(path)
    except configmod.ConfigError as exc:
        print(f"wslb: invalid configuration {path}:\n{exc}", file=sys.stderr)
        return 2
    logs.setup(logging.getLogger().level, cfg.log.format)
    from balancer.aio.app import run

    return run(cfg, path, take_over)


def _check(path: str, deep: bool = False) -> int:
    try:
        cfg = configmod.load(path)
    except configmod.ConfigError as exc:
        print(f"{path}: invalid\n{exc}", file=sys.stderr)
        return 2
    if deep:  # a restart's proof that the code installed now loads (aio/restart.py)
        import balancer.aio.app  # noqa: F401
    n = sum(len(p.backends) for p in cfg.pools)
    print(f"{path}: ok ({logs.count(len(cfg.pools), 'pool')}, {logs.count(n, 'backend')})")
    return 0


def parser() -> argparse.ArgumentParser:
    """``wslb``'s command line: serve (the default), ``check``, ``ctl``, ``-t``, ``--version``."""
    p = argparse.ArgumentParser(
        prog="wslb",
        description="WebSocket-aware load balancer for LLM serving",
        epilog="wslb ctl --help lists the operator commands (backends, drain, reload, ...).",
    )
    p.add_argument("--config", "-c", default="balancer.yaml", help="balancer.yaml path")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "-t",
        "--test",
        action="store_true",
        help="check the config and exit (as nginx -t, haproxy -c): 0, or 2 with every error",
    )
    p.add_argument("-v", "--version", action="version", version=f"wslb {version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    check = sub.add_parser("check", help="validate a config: exit 0, or 2 with every error")
    check.add_argument("file", nargs="?", help="the config file (default: --config's)")
    check.add_argument("--config", "-c", dest="check_config", default=None)
    check.add_argument(
        "--deep",
        action="store_true",
        help="also import every module that serves (a restart's check)",
    )
    p.add_argument("--take-over", default=None, help=argparse.SUPPRESS)  # aio/restart.py
    sub.add_parser("ctl", help="operate a running wslb (wslb ctl --help)", add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``wslb`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["ctl"]:
        from balancer import ctl

        return ctl.main(args[1:])
    ns = parser().parse_args(args)
    logs.setup(getattr(logging, ns.log_level.upper()), "text")  # the config may say json
    if ns.command == "check":
        return _check(ns.file or ns.check_config or ns.config, ns.deep)
    if ns.test:
        return _check(ns.config)
    return _run(ns.config, ns.take_over)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
