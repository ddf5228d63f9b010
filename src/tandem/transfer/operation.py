"""One readable or writable operation as its owner agent tracks it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from tandem.errors import TransferError
from tandem.transfer.descriptor import OpStatus, TransferOpMeta

logger = logging.getLogger(__name__)

ReleaseCallback = Callable[["TransferOp"], None]


class TransferOp:
    """Owner-side state of an operation; all methods are thread-safe.

    Status moves initialized → in_progress → complete, or to errored / cancelled /
    expired from either live status. The first terminal transition wins, sets
    ``reason`` and calls ``on_release(op)`` exactly once (outside the lock): the owner
    unpins its blocks there.
    """

    def __init__(self, meta: TransferOpMeta, on_release: ReleaseCallback | None = None) -> None:
        self.meta = meta
        self.status = OpStatus.INITIALIZED
        self.reason = ""
        self.peer = ""
        self.num_bytes = 0
        self.annex = b""  # what the peer handed over with a completed push (set before COMPLETE)
        self.retire_at = float("inf")  # set by the agent when the op ends
        self._on_release = on_release
        self._lock = threading.Lock()
        self._done = threading.Event()

    @property
    def op_id(self) -> str:
        return self.meta.op_id

    def claim(self, peer: str) -> str | None:
        """initialized → in_progress for ``peer``; returns why not, or None on success."""
        with self._lock:
            if self.status is not OpStatus.INITIALIZED:
                what = f"by {self.peer}" if self.status is OpStatus.IN_PROGRESS else self.reason
                return f"op {self.op_id} is {self.status.value} ({what})"
            self.status = OpStatus.IN_PROGRESS
            self.peer = peer
            return None

    def finish(
        self, status: OpStatus, reason: str = "", num_bytes: int = 0, annex: bytes = b""
    ) -> bool:
        """Move to terminal ``status``; False (and nothing changes) if already terminal.
        ``annex`` is kept (before waiters wake) as what the peer handed over."""
        assert status.is_terminal, status
        with self._lock:
            if self.status.is_terminal:
                return False
            self.status = status
            self.reason = reason or status.value
            self.num_bytes = num_bytes
            self.annex = annex
        log = logger.debug if status is OpStatus.COMPLETE else logger.info
        log("transfer op=%s %s peer=%s reason=%s", self.op_id, status.value, self.peer, reason)
        self._done.set()
        if self._on_release is not None:
            try:
                self._on_release(self)
            except Exception:
                logger.exception("on_release callback of op=%s failed", self.op_id)
        return True

    def wait(self, timeout_s: float) -> OpStatus:
        """Block until terminal; raise `TransferError` unless it completed.

        On timeout the op is left as it is (the caller decides to cancel or retry).
        """
        if not self._done.wait(timeout_s):
            raise TransferError(
                f"transfer op={self.op_id} peer={self.peer or '-'}: not complete after "
                f"{timeout_s:.3g}s (status {self.status.value})"
            )
        if self.status is not OpStatus.COMPLETE:
            raise TransferError(
                f"transfer op={self.op_id} peer={self.peer or '-'} {self.status.value}: "
                f"{self.reason}"
            )
        return self.status
