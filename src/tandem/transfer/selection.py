"""Pick the fastest backend both agents can use for one transfer, and say so in the logs."""

from __future__ import annotations

import logging
import threading

from tandem.transfer.base import TransferBackend
from tandem.transfer.descriptor import TransferOpMeta

logger = logging.getLogger(__name__)

_ANOTHER_HOST = "is on another host"


class BackendSelector:
    """Chooses, in preference order, the first local backend the remote op offers and can
    be reached with. The first choice per (peer, backend) is logged at INFO — or WARNING
    when a faster enabled backend was passed over for a reason other than distance —
    later identical choices at DEBUG. Thread-safe.
    """

    def __init__(self, backends: dict[str, TransferBackend], agent_id: str) -> None:
        self._backends = backends  # insertion order = preference order
        self._agent_id = agent_id
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def update(self, backends: dict[str, TransferBackend]) -> None:
        """Replace the backends (a lazy one started), same preference semantics."""
        self._backends = backends

    def choose(self, remote: TransferOpMeta) -> TransferBackend:
        rejected: list[tuple[str, str]] = []
        for name, backend in self._backends.items():
            if name not in remote.backends:
                rejected.append((name, f"peer {remote.agent_id} does not offer {name}"))
                continue
            reason = backend.unusable_reason(remote)
            if reason is None:
                self._log(remote, name, rejected)
                return backend
            rejected.append((name, reason))
        # tcp is always offered, so this means the config disabled it on one side
        raise LookupError("; ".join(f"{n}: {r}" for n, r in rejected) or "no backends enabled")

    def _log(self, remote: TransferOpMeta, name: str, rejected: list[tuple[str, str]]) -> None:
        with self._lock:
            first = (remote.agent_id, name) not in self._logged
            self._logged.add((remote.agent_id, name))
        is_fallback = any(_ANOTHER_HOST not in reason for _, reason in rejected)
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
