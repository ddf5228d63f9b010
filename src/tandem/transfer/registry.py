"""Transfer backends by name. Optional ones report why they are unavailable."""

from __future__ import annotations

import importlib
import importlib.util
import logging

from tandem.transfer.base import BACKEND_NAMES, TransferBackend

logger = logging.getLogger(__name__)


class BackendUnavailable(Exception):
    """The backend's package or hardware path is missing; the message says which."""


_OPTIONAL = {
    "nixl": ("nixl", "pip install nixl==1.5.1 after torch"),
    "mooncake": ("mooncake", "pip install mooncake-transfer-engine-non-cuda; needs libibverbs1"),
}


def create_backend(name: str, *, agent_id: str, host: str) -> TransferBackend:
    """Build backend ``name``; raise BackendUnavailable when it cannot run here."""
    if name == "shm":
        from tandem.transfer.shm import ShmBackend

        return ShmBackend()
    if name == "tcp":
        from tandem.transfer.tcp import TcpBackend

        return TcpBackend()
    if name in _OPTIONAL:
        hint = _OPTIONAL[name][1]
        if not is_installed(name):
            raise BackendUnavailable(f"{name} is not installed ({hint})")
        try:
            module = importlib.import_module(f"tandem.transfer.{name}_backend")
            backend: TransferBackend = module.create(agent_id=agent_id, host=host)
        except Exception as exc:  # native libraries fail in their own ways
            raise BackendUnavailable(
                f"{name} failed to start: {type(exc).__name__}: {exc}"
            ) from exc
        return backend
    raise ValueError(
        f"unknown transfer backend {name!r}; expected one of: {', '.join(BACKEND_NAMES)}"
    )


def is_installed(name: str) -> bool:
    """Whether backend ``name``'s package is importable (shm and tcp always are)."""
    return name not in _OPTIONAL or importlib.util.find_spec(_OPTIONAL[name][0]) is not None


def installed_backends(names: tuple[str, ...], *, agent_id: str) -> tuple[str, ...]:
    """``names`` whose packages are installed (to start later); logs the missing ones."""
    for name in names:
        if not is_installed(name):
            logger.info("transfer agent=%s: backend %s unavailable: %s is not installed (%s)",
                        agent_id, name, name, _OPTIONAL[name][1])  # fmt: skip
    return tuple(n for n in names if is_installed(n))


def create_backends(
    names: tuple[str, ...], *, agent_id: str, host: str
) -> dict[str, TransferBackend]:
    """Every available backend of ``names``, in that (preference) order; logs the missing."""
    backends: dict[str, TransferBackend] = {}
    for name in names:
        try:
            backends[name] = create_backend(name, agent_id=agent_id, host=host)
        except BackendUnavailable as exc:
            logger.info("transfer agent=%s: backend %s unavailable: %s", agent_id, name, exc)
    return backends
