"""Command line: ``wslb --config F``, ``wslb check --config F``, ``wslb ctl ...``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from balancer import config as configmod
from balancer import logs

__all__ = ["main"]


def _run(path: str) -> int:
    try:
        cfg = configmod.load(path)
    except configmod.ConfigError as exc:
        print(f"wslb: invalid configuration {path}:\n{exc}", file=sys.stderr)
        return 2
    logs.setup(logging.getLogger().level, cfg.log.format)
    from balancer.aio.app import run

    return run(cfg, path)


def _check(path: str) -> int:
    try:
        cfg = configmod.load(path)
    except configmod.ConfigError as exc:
        print(f"{path}: invalid\n{exc}", file=sys.stderr)
        return 2
    n = sum(len(p.backends) for p in cfg.pools)
    print(f"{path}: ok ({len(cfg.pools)} pool(s), {n} backend(s))")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``wslb`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["ctl"]:
        from balancer import ctl

        return ctl.main(args[1:])
    parser = argparse.ArgumentParser(
        prog="wslb", description="WebSocket-aware load balancer for LLM serving"
    )
    parser.add_argument("--config", "-c", default="balancer.yaml", help="balancer.yaml path")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    sub = parser.add_subparsers(dest="command")
    check = sub.add_parser("check", help="validate a config: exit 0, or 2 with every error")
    check.add_argument("--config", "-c", dest="check_config", default=None)
    ns = parser.parse_args(args)
    logging.basicConfig(level=getattr(logging, ns.log_level.upper()), format=logs.TEXT_FORMAT)
    if ns.command == "check":
        return _check(ns.check_config or ns.config)
    return _run(ns.config)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
