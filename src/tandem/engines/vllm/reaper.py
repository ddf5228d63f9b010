"""Children die with the worker: vLLM's `AsyncLLM` spawns an EngineCore process (which spawns
its Worker); a SIGKILLed host leaves both running (~3 GB). The reaper is a tiny child of the
worker, started before the engine (so it inherits none of the environment vLLM changes), that
remembers the worker's descendants and SIGKILLs them once the worker is gone.

It learns of the death from its stdin, a pipe only the worker holds: end of file without the
"done" line the worker writes after a clean engine shutdown means the worker died. Signals
sent to the whole process group (a terminal's Ctrl-C, `timeout`) are ignored: the worker
handles those itself and says "done" when its engine is down.

Run as `python -m tandem.engines.vllm.reaper <worker_pid>`.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import time

import psutil

logger = logging.getLogger(__name__)

# how often the worker's descendants are listed (a scan of /proc): fast while they change
# (vLLM's start spawns EngineCore, then its Worker), slow once they have been stable for a
# while (4 scans a second cost ~1 % of a core for a whole serving life). The worker's death
# itself is seen at once, as end of file on stdin.
POLL_S = 0.25
STABLE_POLL_S = 2.0
STABLE_AFTER_S = 30.0
READY_TIMEOUT_S = 30.0


class Reaper:
    """The worker's handle on its reaper process. Returns once the reaper has looked at the
    worker's children once (children started before are covered from then on)."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.engines.vllm.reaper", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], READY_TIMEOUT_S)
        if not ready or self._proc.stdout.readline().strip() != b"ready":
            logger.warning("the reaper pid=%d did not report ready", self._proc.pid)

    def done(self) -> None:
        """The engine is shut down: let the reaper go without killing anything."""
        proc = self._proc
        if proc.stdin is not None and not proc.stdin.closed:
            try:
                proc.stdin.write(b"done\n")
                proc.stdin.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _kill_all(pids: set[int]) -> None:
    for pid in pids:
        try:
            for child in psutil.Process(pid).children(recursive=True):
                child.kill()
            os.kill(pid, signal.SIGKILL)
        except (psutil.Error, OSError):
            pass


def main(worker_pid: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    me = os.getpid()
    known: set[int] = set()
    stdin = sys.stdin.buffer
    first = True
    changed_at = time.monotonic()
    while True:
        stable = time.monotonic() - changed_at >= STABLE_AFTER_S
        timeout = 0 if first else STABLE_POLL_S if stable else POLL_S
        readable, _, _ = select.select([stdin], [], [], timeout)
        if readable:
            line = stdin.readline()
            if line.strip() == b"done":
                return 0
            if not line:  # the worker died without saying done
                _kill_all(known)
                return 0
        try:
            worker = psutil.Process(worker_pid)
            if worker.status() == psutil.STATUS_ZOMBIE:  # dead, not yet waited for
                raise psutil.NoSuchProcess(worker_pid)
            now_known = {c.pid for c in worker.children(recursive=True) if c.pid != me}
            if now_known != known:
                known, changed_at = now_known, time.monotonic()
        except psutil.Error:  # gone already
            _kill_all(known)
            return 0
        if first:
            first = False
            sys.stdout.write("ready\n")
            sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main(int(sys.argv[1])))
