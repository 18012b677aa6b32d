"""Entry point of one serving process of ``workers: N`` (started by the supervisor, not by hand).

``python -P -m balancer.aio.serving --config F --index I --processes N --run-dir D``: loads the
config, tags its log lines with its index, and runs ``app.serve`` with the ``ProcessLink`` that
ties it to the supervisor's board and run directory (``multi.py``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from balancer import logs
from balancer.aio.app import ProcessLink, run_loop, serve
from balancer.config import ConfigError
from balancer.config import load as load_config

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wslb-serve", description=__doc__)
    p.add_argument("--config", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--processes", type=int, required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--log-level", default="info")
    p.add_argument("--take-over", default=None, help="a restart's socket (aio/restart.py)")
    ns = p.parse_args(argv)
    logs.setup(getattr(logging, ns.log_level.upper(), logging.INFO), "text", str(ns.index))
    try:
        config = load_config(ns.config)
    except ConfigError as exc:
        print(f"wslb: invalid configuration {ns.config}:\n{exc}", file=sys.stderr)
        return 2
    logs.setup(logging.getLogger().level, config.log.format, process=str(ns.index))
    link = ProcessLink(
        ns.index,
        ns.processes,
        os.path.join(ns.run_dir, "board"),
        os.path.join(ns.run_dir, f"admin-{ns.index}.sock"),
    )
    return run_loop(serve(config, ns.config, link, take_over=ns.take_over))


if __name__ == "__main__":
    sys.exit(main())
