"""Transfer backends by name. Optional ones report why they are unavailable."""

from __future__ import annotations

import importlib
import importlib.util
import logging

from tandem.disagg.transfer.base import BACKEND_NAMES, TransferBackend

logger = logging.getLogger(__name__)


class BackendUnavailable(Exception):
    """The backend's package or hardware path is missing; the message says which."""


def create_backend(name: str, *, agent_id: str, host_id: str) -> TransferBackend:
    """Build backend ``name``; raise BackendUnavailable when it cannot run here."""
    if name == "shm":
        from tandem.disagg.transfer.shm import ShmBackend

        return ShmBackend(host_id)
    if name == "tcp":
        from tandem.disagg.transfer.tcp import TcpBackend

        return TcpBackend()
    if name == "mooncake":
        if importlib.util.find_spec("mooncake") is None:
            raise BackendUnavailable("mooncake is not installed (mooncake-transfer-engine)")
        raise BackendUnavailable("mooncake is installed but tandem has no mooncake backend yet")
    if name == "nixl":
        if importlib.util.find_spec("nixl") is None:
            raise BackendUnavailable("nixl is not installed (pip install nixl==1.5.1)")
        try:
            module = importlib.import_module(f"tandem.disagg.transfer.{name}_backend")
        except ImportError as exc:
            raise BackendUnavailable(f"{name} is not installed ({exc})") from exc
        backend: TransferBackend = module.create(agent_id=agent_id)
        return backend
    raise ValueError(
        f"unknown transfer backend {name!r}; expected one of: {', '.join(BACKEND_NAMES)}"
    )


def create_backends(
    names: tuple[str, ...], *, agent_id: str, host_id: str
) -> dict[str, TransferBackend]:
    """Every available backend of ``names``, in that (preference) order; logs the missing."""
    backends: dict[str, TransferBackend] = {}
    for name in names:
        try:
            backends[name] = create_backend(name, agent_id=agent_id, host_id=host_id)
        except BackendUnavailable as exc:
            logger.info("transfer agent=%s: backend %s unavailable: %s", agent_id, name, exc)
    return backends
