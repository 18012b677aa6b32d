"""The keeper: the process a supervisor (systemd, Kubernetes, a shell) started, after its first
hot restart (``aio/restart.py``).

A restart's new code runs in a new process, but the pid a supervisor watches must stay: it is
the one systemd's ``MainPID`` names, a container's PID 1, the one ``kill`` and ``wslb ctl`` users
signal. So the old process, once it has handed everything on, ``exec``s this small program in
its place (same pid; a bare interpreter, 14 MB) instead of exiting, as HAProxy's master process
stays while its workers are replaced. The keeper:

- is a *child subreaper* (``PR_SET_CHILD_SUBREAPER``): each later restart's old process exits
  and its children (the new serving process, spawned workers) become the keeper's, so nothing
  is orphaned to init and every exit is reaped;
- learns which process serves from a pipe (``serving PID`` lines, written by each process that
  takes over) and passes it SIGTERM, SIGINT, SIGHUP and SIGUSR2, so a signal to the pid the
  supervisor knows still stops, reloads or restarts wslb;
- exits with the serving process's status when it exits with no successor, after SIGTERM to
  the children left (the spawned workers), so a supervisor sees wslb stop as before.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import select
import signal
import sys
import time

__all__ = ["main"]

PR_SET_CHILD_SUBREAPER = 36
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2)
CHILD_GRACE = 5.0  # spawned workers' time to stop after the last serving process exited


def _children() -> list[int]:
    me = str(os.getpid())
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:  # the field after the state is the parent's pid
            out.append(int(name))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wslb-keeper", description=__doc__)
    p.add_argument("--pipe", type=int, required=True)
    p.add_argument("--serving", type=int, required=True)
    ns = p.parse_args(argv)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    serving = ns.serving
    pending: list[int] = []

    def forward(sig: int, _frame: object) -> None:
        pending.append(sig)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # blocked by the exec's caller
    os.set_blocking(ns.pipe, False)
    # poll, not select: the pipe was made by a process holding thousands of sockets, so its
    # number is often above select's 1024.
    poller = select.poll()
    poller.register(ns.pipe, select.POLLIN)
    buf = b""
    status = 0
    exited: dict[int, int] = {}
    while True:
        while pending:
            with contextlib.suppress(ProcessLookupError):
                os.kill(serving, pending.pop(0))
        with contextlib.suppress(InterruptedError):
            if poller.poll(200):
                with contextlib.suppress(BlockingIOError):
                    chunk = os.read(ns.pipe, 4096)
                    buf += chunk
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        word, _, num = line.decode(errors="replace").partition(" ")
                        if word == "serving" and num.isdigit():
                            serving = int(num)
        while True:  # reap every child that exited (adopted orphans included)
            try:
                pid, code = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid = 0
            if pid == 0:
                break
            exited[pid] = os.waitstatus_to_exitcode(code)
        if serving in exited:
            status = exited[serving]
            time.sleep(0.2)  # a successor that took over just now says so on the pipe
            with contextlib.suppress(BlockingIOError, OSError):
                buf += os.read(ns.pipe, 4096)
            successor = [
                int(num)
                for word, _, num in (ln.decode().partition(" ") for ln in buf.split(b"\n"))
                if word == "serving" and num.isdigit()
            ]
            if successor and successor[-1] not in exited:
                serving, buf = successor[-1], b""
                continue
            break
    _stop_children()
    return status if status >= 0 else 128 - status


def _stop_children() -> None:
    kids = _children()
    for pid in kids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    until = time.monotonic() + CHILD_GRACE
    while kids and time.monotonic() < until:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        kids = [k for k in kids if k in _children()]
        time.sleep(0.05)
    for pid in kids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
