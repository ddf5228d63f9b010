"""A vLLM worker's threads stay on the cores tandem gave the worker (imported by vLLM's own
Worker process through `nixl_connector.py`; no vLLM import here).

`tandem serve` gives each vLLM worker on a host its own cores (`--vllm-cpus`: vLLM binds the
Worker's OMP threads, its main thread first, to them). vLLM's NixlConnector on CPU then moves
the thread that builds it (the Worker's main thread: its model steps and its busy loop) to the
last core of each NUMA node, to keep `start_load_kv` off the model's cores: every worker's
main thread on one host ends up on that one core. vLLM's message-queue readers spin on
`sched_yield` for a second after each message, and on that shared core the kernel's scheduler
(Linux 6.18, EEVDF) left the spinning thread of an idle worker runnable but unscheduled for
30 s beside the busy worker's thread (measured: state R, no CPU time): the idle worker's
engine could not reach it, so its peer KV fetch from the busy worker waited until that worker
shut down. `kept_affinity` undoes the move.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

_TASKS = "/proc/self/task"


@contextlib.contextmanager
def kept_affinity() -> Iterator[None]:
    """What runs inside may move the calling thread to other cores; on exit that thread, and
    the threads started inside that inherited the move, are back on the cores it had. Other
    threads, and a new thread that chose its own cores, are left alone. Linux only (a no-op
    where the OS has no thread affinity); OSError of a thread that ended meanwhile is ignored.
    """
    if not hasattr(os, "sched_getaffinity"):
        yield
        return
    cores = os.sched_getaffinity(0)
    before = _thread_ids()
    try:
        yield
    finally:
        moved_to = os.sched_getaffinity(0)
        if moved_to != cores:
            caller = threading.get_native_id()
            for tid in _thread_ids() - before - {caller}:
                with contextlib.suppress(OSError):
                    if os.sched_getaffinity(tid) == moved_to:
                        os.sched_setaffinity(tid, cores)
            os.sched_setaffinity(0, cores)


def _thread_ids() -> set[int]:
    try:
        return {int(name) for name in os.listdir(_TASKS)}
    except OSError:  # no procfs: only the calling thread is put back
        return set()
