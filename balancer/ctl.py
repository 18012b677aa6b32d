"""``wslb ctl``: the operator's client for the admin API.

Tables for people, ``--json`` for scripts. ``drain ID --wait`` redraws a progress bar until the
backend is drained (in cluster mode: on every instance). ``add``/``remove`` and ``--wait-admin``
serve Kubernetes hooks (a sidecar registers its pod's worker when it starts, removes it when
the pod goes). ``dashboard`` prints the dashboard's URL and the token to sign in with, after one
authenticated call proves both work. The token is ``--token``, else ``WSLB_ADMIN_TOKEN``, else
the one a wslb with no configured token generated for the admin URL's port
(``balancer/admintoken.py``). Exit status:
0 on success, 1 when the API refused (its error is printed), 2 for usage errors, 3 when the admin
API cannot be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any, TextIO
from urllib.parse import urlsplit

from balancer import admintoken
from balancer.logs import count

__all__ = ["find_token", "main"]


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Client:
    """A minimal synchronous JSON client (no dependency: ctl must start fast)."""

    def __init__(self, base: str, token: str | None, timeout: float = 10.0) -> None:
        self.base = base.rstrip("/")
        self.token = token
        self.timeout = timeout

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                message = json.loads(raw).get("error", raw.decode(errors="replace"))
            except (ValueError, AttributeError):
                message = raw.decode(errors="replace")
            raise ApiError(exc.code, f"HTTP {exc.code}: {message}") from None


def find_token(admin_url: str, given: str | None) -> str | None:
    """The token to send: the one given, else the generated one of a local wslb whose admin API
    listens on the URL's port (a remote one's file is not on this machine)."""
    if given:
        return given
    try:
        parts = urlsplit(admin_url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    return admintoken.read(port)


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]], out: TextIO) -> None:
    """Print rows as an aligned text table with the given (key, heading) columns."""
    cells = [[h for _, h in columns]]
    for r in rows:
        cells.append(["" if r.get(k) is None else _fmt(r.get(k)) for k, _ in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for row in cells:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v)


def _backend_rows(backends: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for b in backends:
        sig = b.get("signals") or {}
        rows.append(
            {
                **b,
                "gpu": sig.get("gpu_util"),
                "kv": sig.get("kv_cache_usage"),
                "eff": b.get("effective_weight"),
                "stale": b.get("signals_stale"),
                "reason": (b.get("health") or {}).get("reason") if b.get("state") == "down" else "",
            }
        )
    return rows


def _failover_cells(view: Any) -> dict[str, str]:
    """FAILOVERS and JOURNAL: the journal's size, or why a crash would end the session."""
    if not isinstance(view, dict):
        return {"failovers": "-", "journal": "off"}
    size = int(view.get("journal_bytes") or 0)
    shown = f"{size / 1024:.1f}KiB" if size >= 1024 else f"{size}B"
    if not view.get("protected"):
        shown += f" (unprotected: {view.get('why_not')})"
    return {"failovers": str(view.get("failovers", 0)), "journal": shown}


def bar(done: int, total: int, width: int = 30) -> str:
    filled = width if total <= 0 else int(width * done / total)
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def drain_wait(client: Client, bid: str, out: TextIO, as_json: bool, poll: float = 0.2) -> int:
    """Poll the backend until drained, redrawing one progress line."""
    tty = out.isatty()
    while True:
        b = client.call("GET", f"/backends/{bid}")
        d = b.get("drain") or {}
        total = int(d.get("sessions_at_start") or 0)
        left = int(b.get("sessions") or 0)
        for i in (b.get("cluster") or {}).get("instances", {}).values():
            left = max(left, int(i.get("left") or 0))  # the slowest instance
        line = (
            f"{bid} {b['state']:<8} {bar(total - left, total)} {left} left, "
            f"{d.get('migrated', 0)} migrated, "
            f"{d.get('closed_after_answer', 0) + d.get('closed_at_timeout', 0)} closed"
        )
        if not as_json:
            out.write(("\r" + line) if tty else (line + "\n"))
            out.flush()
        # Cluster mode: done when every instance has drained it, not only the one asked.
        cluster = b.get("cluster")
        if b["state"] == "drained" and (cluster is None or cluster.get("state") == "drained"):
            if as_json:
                out.write(json.dumps(b) + "\n")
            elif tty:
                out.write("\n")
            return 0
        if b["state"] == "active":
            out.write(f"\n{bid} was undrained\n")
            return 1
        time.sleep(poll)


def token_source(args: argparse.Namespace, admin: str) -> str:
    """Where the token ctl sends came from, in words (for ``dashboard``)."""
    if args.token:
        from_env = args.token == os.environ.get("WSLB_ADMIN_TOKEN")
        return "$WSLB_ADMIN_TOKEN" if from_env else "--token"
    return str(admintoken.token_path(urlsplit(admin).port or 80))


def admin_url(text: str) -> str:
    """The admin API's base URL from ``--admin``: a URL, or ``HOST:PORT`` (HAProxy's and
    nginx's habit) taken as ``http://HOST:PORT``."""
    text = text.strip()
    if "://" not in text:
        text = "http://" + text
    return text.rstrip("/")


def _global_options(p: argparse.ArgumentParser, suppress: bool) -> None:
    """The options every ``wslb ctl`` command takes, before or after its name (a subcommand's
    copy defaults to SUPPRESS so that it only overrides what was given there)."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    p.add_argument(
        "--admin",
        default=default(os.environ.get("WSLB_ADMIN_URL", "http://127.0.0.1:8081")),
        metavar="URL|HOST:PORT",
        help="admin API address (env WSLB_ADMIN_URL; default http://127.0.0.1:8081)",
    )
    p.add_argument(
        "--token",
        default=default(os.environ.get("WSLB_ADMIN_TOKEN") or None),
        help="admin bearer token (env WSLB_ADMIN_TOKEN; default: the token file a local wslb "
        "generated for the --admin port)",
    )
    p.add_argument(
        "--json", action="store_true", default=default(False), help="machine-readable output"
    )
    p.add_argument(
        "--wait-admin",
        type=float,
        default=default(0.0),
        metavar="SECONDS",
        help="retry while the admin API cannot be reached, up to SECONDS (start-up hooks)",
    )


COMMANDS = (
    ("dashboard", "print the dashboard's URL and the admin token to sign in with"),
    ("backends", "list backends"),
    ("sessions", "list live sessions"),
    ("drain", "drain a backend"),
    ("undrain", "put a backend back to active"),
    ("migrate", "move one live session"),
    ("reload", "reread the config file"),
    ("restart", "hand every listener and live session to the code installed now"),
    ("add", "add a backend (cluster mode: to every instance)"),
    ("remove", "remove a drained backend"),
)


def parser() -> argparse.ArgumentParser:
    """The command line of ``wslb ctl`` (also what tests check deployment hooks against)."""
    p = argparse.ArgumentParser(prog="wslb ctl", description="operate a running wslb")
    _global_options(p, suppress=False)
    common = argparse.ArgumentParser(add_help=False)
    _global_options(common, suppress=True)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    cmds = {name: sub.add_parser(name, help=text, parents=[common]) for name, text in COMMANDS}
    cmds["sessions"].add_argument("--backend")
    dr = cmds["drain"]
    dr.add_argument("id")
    dr.add_argument("--wait", action="store_true", help="show progress until drained")
    dr.add_argument("--no-migrate", action="store_true", help="close sessions instead (1012)")
    dr.add_argument("--timeout", help="e.g. 60s")
    cmds["undrain"].add_argument("id")
    mg = cmds["migrate"]
    mg.add_argument("sid")
    mg.add_argument("--to", help="target backend (default: where the ring sends it)")
    ad = cmds["add"]
    ad.add_argument("id")
    ad.add_argument("url", help="ws://, http://, wss:// or https:// URL of the worker")
    ad.add_argument("--weight", type=float)
    ad.add_argument("--pool", help="pool name (default: the first)")
    ad.add_argument("--metrics-url", help="scrape load signals here (an engine's /metrics)")
    ad.add_argument("--exist-ok", action="store_true", help="succeed if the id exists")
    cmds["remove"].add_argument("id")
    return p


def main(argv: Sequence[str]) -> int:
    """``wslb ctl ...``; returns the exit status."""
    args = parser().parse_args(list(argv))
    args.admin = admin_url(args.admin)
    client = Client(args.admin, find_token(args.admin, args.token))
    if args.wait_admin > 0:
        deadline = time.monotonic() + args.wait_admin
        while True:
            try:
                client.call("GET", "/healthz")
                break
            except (urllib.error.URLError, OSError):
                if time.monotonic() >= deadline:
                    break  # the command itself reports the failure
                time.sleep(0.5)
    out = sys.stdout
    try:
        if args.cmd == "dashboard":
            client.call("GET", "/backends")  # the URL answers and the token is the right one
            data = {"url": args.admin + "/ui", "token": client.token}
            if not args.json:
                source = token_source(args, args.admin) if client.token else "none needed"
                out.write(f"dashboard: {data['url']}\n")
                out.write(f"token:     {client.token or '(none)'}  ({source})\n")
                out.write("open the URL, paste the token into Admin token, press Sign in\n")
                return 0
        elif args.cmd == "backends":
            data = client.call("GET", "/backends")
            if not args.json:
                table(
                    _backend_rows(data),
                    [("id", "ID"), ("state", "STATE"), ("sessions", "SESSIONS"),
                     ("weight", "WEIGHT"), ("eff", "EFFECTIVE"), ("gpu", "GPU"), ("kv", "KV"),
                     ("stale", "STALE"), ("url", "URL"), ("reason", "REASON")],
                    out,
                )  # fmt: skip
                return 0
        elif args.cmd == "sessions":
            q = f"?backend={args.backend}" if args.backend else ""
            data = client.call("GET", "/sessions" + q)
            if not args.json:
                rows = [
                    {**s, "in": s["messages"]["client_to_worker"],
                     "out": s["messages"]["worker_to_client"],
                     "age": f"{max(0.0, time.time() - s['since']):.0f}s",
                     **_failover_cells(s.get("failover"))}
                    for s in data
                ]  # fmt: skip
                table(
                    rows,
                    [("id", "SESSION"), ("backend", "BACKEND"), ("client", "CLIENT"),
                     ("age", "AGE"), ("in", "MSGS IN"), ("out", "MSGS OUT"),
                     ("migrations", "MIGRATIONS"), ("failovers", "FAILOVERS"),
                     ("journal", "JOURNAL")],
                    out,
                )  # fmt: skip
                return 0
        elif args.cmd == "drain":
            body: dict[str, Any] = {"migrate": not args.no_migrate}
            if args.timeout:
                body["timeout"] = args.timeout
            data = client.call("POST", f"/backends/{args.id}/drain", body)
            if args.wait:
                return drain_wait(client, args.id, out, args.json)
            if not args.json:
                out.write(f"{args.id}: {data['state']} ({count(data['sessions'], 'session')})\n")
                return 0
        elif args.cmd == "undrain":
            data = client.call("POST", f"/backends/{args.id}/undrain", {})
            if not args.json:
                out.write(f"{args.id}: {data['state']}\n")
                return 0
        elif args.cmd == "migrate":
            body = {"to": args.to} if args.to else {}
            data = client.call("POST", f"/sessions/{args.sid}/migrate", body)
            if not args.json:
                out.write(f"{args.sid}: moved to {data['backend']} (pause {data['pause_ms']} ms)\n")
                return 0
        elif args.cmd == "reload":
            data = client.call("POST", "/reload", {})
        elif args.cmd == "restart":
            client.timeout = max(client.timeout, 120.0)  # it answers when the new code has all
            data = client.call("POST", "/restart", {})
            if not args.json:
                moved = data["sessions"]
                out.write(
                    f"restarted: pid {data['old']['pid']} -> {data['new']['pid']}, "
                    f"version {data['new']['version']}, {count(moved['moved'], 'session')} moved, "
                    f"not moved {moved['not_moved'] or 'none'}, pause p99 "
                    f"{data['pause_ms']['p99']} ms, {data['seconds']} s\n"
                )
                return 0
        elif args.cmd == "add":
            body = {"id": args.id, "url": args.url}
            if args.weight is not None:
                body["weight"] = args.weight
            if args.pool:
                body["pool"] = args.pool
            if args.metrics_url:
                body["metrics_url"] = args.metrics_url
            try:
                data = client.call("POST", "/backends", body)
            except ApiError as exc:
                if not (args.exist_ok and exc.status == 409):
                    raise
                data = client.call("GET", f"/backends/{args.id}")
            if not args.json:
                out.write(f"{args.id}: {data['state']}\n")
                return 0
        elif args.cmd == "remove":
            data = client.call("DELETE", f"/backends/{args.id}")
            if not args.json:
                out.write(f"{args.id}: removed\n")
                return 0
        out.write(json.dumps(data, indent=None if args.json else 2) + "\n")
        return 0
    except ApiError as exc:
        print(f"wslb ctl: {exc}", file=sys.stderr)
        if exc.status == 401 and client.token is None:
            where = admintoken.token_path(urlsplit(args.admin).port or 80)
            print(
                f"wslb ctl: no token given (--token, WSLB_ADMIN_TOKEN) and none in {where}",
                file=sys.stderr,
            )
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"wslb ctl: cannot reach {args.admin}: {exc}", file=sys.stderr)
        return 3
