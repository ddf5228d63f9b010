"""NIXL agents whose progress thread pauses when idle.

NIXL's Python agent hard-codes its progress thread's idle delay (``pthrDelay``) to 0: the
thread polls UCX with no pause, about 0.3 core per idle agent on a 2-core host. The thread
cannot be turned off (the passive side must progress UCX's connection set-up), so agents
created inside `idle_progress` get `PROGRESS_DELAY_US` instead (measured idle: 0.30 -> 0.02
core). Used by the nixl backend and by the vLLM connector (`tandem.engines.vllm`); it takes
NIXL's API module as an argument and imports nothing of NIXL itself.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol

PROGRESS_DELAY_US = 1000

_lock = threading.Lock()  # the bindings are swapped module-wide while one agent starts


class NixlApi(Protocol):
    """NIXL's ``nixl._api`` module, as far as this uses it: it creates agents through
    ``nixlBind.nixlAgent(name, config)``."""

    nixlBind: Any  # NIXL's compiled bindings (untyped)


class _DelayedProgress:
    """NIXL's bindings module, except that agents get `PROGRESS_DELAY_US`."""

    def __init__(self, bindings: Any) -> None:
        self._bindings = bindings

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # NIXL's name
        config.pthrDelay = PROGRESS_DELAY_US
        return self._bindings.nixlAgent(name, config)


@contextlib.contextmanager
def idle_progress(nixl_api: NixlApi) -> Iterator[None]:
    """While inside, the agents ``nixl_api`` (``nixl._api``) creates get `PROGRESS_DELAY_US`.
    Thread-safe: one agent starts at a time; the bindings are restored on exit."""
    with _lock:
        bindings = nixl_api.nixlBind
        nixl_api.nixlBind = _DelayedProgress(bindings)
        try:
            yield
        finally:
            nixl_api.nixlBind = bindings
