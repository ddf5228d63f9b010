"""Pick the fastest backend both agents can use for one transfer, and say so in the logs."""

from __future__ import annotations

import logging
import threading

from tandem.transfer.base import TransferBackend
from tandem.transfer.descriptor import TransferOpMeta

logger = logging.getLogger(__name__)


class BackendSelector:
    """Chooses, in preference order, the first local backend the remote op offers and can
    be reached with. shm only where the peer's shared-memory probe read back here (the
    caller's `no_shared_memory` is None); a peer without that proof is another host or
    container, whose shm is passed over without an attempt. The first choice per (peer,
    backend) is logged at INFO — or WARNING when a faster enabled backend was passed over for
    a reason other than that distance — later identical choices at DEBUG. Thread-safe.
    """

    def __init__(self, backends: dict[str, TransferBackend], agent_id: str) -> None:
        self._backends = backends  # insertion order = preference order
        self._agent_id = agent_id
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def update(self, backends: dict[str, TransferBackend]) -> None:
        """Replace the backends (a lazy one started), same preference semantics."""
        self._backends = backends

    def choose(self, remote: TransferOpMeta, no_shared_memory: str | None) -> TransferBackend:
        """`no_shared_memory`: why this agent shares no /dev/shm with the peer (None: proven
        shared, `shm.ShmProofs`). Raises LookupError naming every backend's reason."""
        rejected: list[tuple[str, str]] = []
        is_fallback = False
        for name, backend in self._backends.items():
            if name not in remote.backends:
                rejected.append((name, f"peer {remote.agent_id} does not offer {name}"))
                is_fallback = True
                continue
            if name == "shm" and no_shared_memory is not None:
                rejected.append((name, f"no shared /dev/shm with peer: {no_shared_memory}"))
                continue
            reason = backend.unusable_reason(remote)
            if reason is None:
                self._log(remote, name, rejected, is_fallback)
                return backend
            rejected.append((name, reason))
            is_fallback = True
        # tcp is always offered, so this means the config disabled it on one side
        raise LookupError("; ".join(f"{n}: {r}" for n, r in rejected) or "no backends enabled")

    def _log(
        self, remote: TransferOpMeta, name: str, rejected: list[tuple[str, str]], is_fallback: bool
    ) -> None:
        with self._lock:
            first = (remote.agent_id, name) not in self._logged
            self._logged.add((remote.agent_id, name))
        level = logging.WARNING if is_fallback else logging.INFO
        if not first:
            level = logging.DEBUG
        why = "; ".join(f"{n} unusable: {r}" for n, r in rejected) or "fastest path"
        logger.log(
            level,
            "transfer agent=%s peer=%s backend=%s%s (%s)",
            self._agent_id,
            remote.agent_id,
            name,
            " is a FALLBACK" if is_fallback else "",
            why,
        )
