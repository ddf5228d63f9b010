"""A child process of `tandem serve` that dies with its parent, whatever kills the parent.

`python -m tandem.cli.child --parent-pid P --life-fd F [--run-dir D] -- worker ARGS` runs
`tandem worker ARGS` in this process after arranging two ways to notice that `tandem serve` is
gone:

1. Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG, SIGTERM)`): the kernel sends SIGTERM
   as the parent exits, even by SIGKILL; the worker then unregisters and drains (its frontend
   is gone, so its streams are already cancelled).
2. A lifeline: the read end `F` of a pipe whose write end only the parent holds. A watch thread
   blocks on it; end of file means every thread of the parent is gone (the fallback where
   prctl is missing, and exact where PDEATHSIG is early: it fires when the forking *thread*
   exits). The thread then sends SIGTERM itself and, if the worker is still alive
   `ORPHAN_GRACE_S` later, ends the process. The parent writes one byte before a normal stop,
   so the child can tell "stopped by serve" from "orphaned".

An orphaned worker removes the stack's run directory on its way out (every orphan tries; a
missing directory is not an error), so no discovery records are left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import sys
import threading
import time

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
ORPHAN_GRACE_S = 3.0
ORPHAN_WAIT_S = 1.0  # how long an exiting child waits to learn whether it is orphaned


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send `sig` to this process when its parent exits. False where the
    platform has no prctl (the watch thread still notices)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def is_orphan(parent_pid: int) -> bool:
    """True once this process has been re-parented (its parent `parent_pid` exited)."""
    return os.getppid() != parent_pid


def remove_run_dir(run_dir: str | None) -> None:
    if run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)


class Lifeline:
    """Watches the parent's pipe on a daemon thread: `stopping` is set when the parent
    announced a normal stop, `orphaned` when the pipe reached end of file without one."""

    def __init__(self, fd: int, run_dir: str | None) -> None:
        self.fd, self.run_dir = fd, run_dir
        self.stopping = threading.Event()
        self.orphaned = threading.Event()
        threading.Thread(target=self._watch, name="lifeline", daemon=True).start()

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 1)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            break
        if data:  # one byte is this child's share: reading on would take a sibling's
            self.stopping.set()
            return
        self.orphaned.set()
        logger.warning("parent is gone; stopping")
        with contextlib.suppress(ProcessLookupError):
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(ORPHAN_GRACE_S)
        logger.error("still alive %.0f s after the parent died; exiting now", ORPHAN_GRACE_S)
        remove_run_dir(self.run_dir)
        os._exit(1)

    def clean_up_if_orphaned(self) -> None:
        """At exit: remove the run directory if the parent died (waiting a little for the
        pipe's end of file, which may trail the parent-death signal)."""
        deadline = time.monotonic() + ORPHAN_WAIT_S
        while not (self.stopping.is_set() or self.orphaned.is_set()):
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        if self.orphaned.is_set():
            remove_run_dir(self.run_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.cli.child", description=__doc__)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--life-fd", type=int, required=True, help="read end of the lifeline")
    parser.add_argument("--run-dir", default=None, help="removed when orphaned")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- tandem command and args")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    set_parent_death_signal()
    if is_orphan(args.parent_pid):  # the parent died before prctl took effect
        remove_run_dir(args.run_dir)
        return 1
    lifeline = Lifeline(args.life_fd, args.run_dir)
    from tandem.cli.main import main as tandem_main

    try:
        return tandem_main(command)
    finally:
        lifeline.clean_up_if_orphaned()


if __name__ == "__main__":
    raise SystemExit(main())
