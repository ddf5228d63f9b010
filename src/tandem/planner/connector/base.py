"""The `Connector` protocol: the planner's hands, one small seam per platform.

`inprocess` (workers on the planner's own event loop; tests), `local` (`tandem worker`
processes on this host), `ray` (workers as Ray actors). A Kubernetes connector would patch a
Deployment's scale subresource behind the same four calls.
"""

from __future__ import annotations

from typing import Protocol

from tandem.errors import ServingError


class ConnectorError(ServingError):
    """A connector could not start, drain or stop a worker."""


class Connector(Protocol):
    """All calls from one event loop; none blocks the loop for long."""

    async def add_worker(self, component: str) -> str:
        """Start one worker of pool `component`; return the instance id it will register
        under (known before it is ready). Raises ConnectorError if it cannot be started."""
        ...

    async def drain_worker(self, component: str, worker_id: str) -> None:
        """Ask the worker to drain: unregister (routers stop sending), let its in-flight
        requests finish within its grace period, then exit. Returns once asked."""
        ...

    async def kill_worker(self, component: str, worker_id: str) -> None:
        """Stop a worker now (one given up on before it became ready). Idempotent."""
        ...

    def manages(self, worker_id: str) -> bool:
        """True for a live worker this connector started (it can drain it)."""
        ...

    async def close(self) -> None:
        """Drain every worker still running (bounded by their grace), then release resources."""
        ...


CONNECTOR_NAMES = ("inprocess", "local", "ray")  # modules of tandem.planner.connector


def connector_names() -> list[str]:
    return sorted(CONNECTOR_NAMES)
