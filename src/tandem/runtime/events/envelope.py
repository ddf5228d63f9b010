"""Authenticated event-plane messages: an HMAC tag per message, keyed by the cluster secret.

Why a tag per message rather than ZMQ CURVE: the same envelope works on every backend (ZMQ
is brokerless, NATS has a broker that may run without auth), it needs no key distribution
beyond the secret every process already holds, and a receiver can drop a forged message
without trusting the connection it came on. What it does not give is secrecy: a local process
that connects to a ZMQ publisher can still read events (block hashes), as it can on NATS.

Wire layout (version 1): b"TEV1" | publisher_id (16 bytes) | seq (u64) | time_s (f64) |
tag (32 bytes) | payload, with tag = HMAC(key, subject, header, payload). A receiver drops a
message whose tag does not verify, that is older than `max_age_s`, or whose seq is not above
the last one it saw from that publisher (a replay).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
import time
from collections import OrderedDict

from tandem.runtime.secret import key_for, new_nonce

logger = logging.getLogger(__name__)
MAGIC = b"TEV1"
_HEADER = struct.Struct(">4s16sQd")
_TAG_BYTES = 32
OVERHEAD_BYTES = _HEADER.size + _TAG_BYTES
PURPOSE = "event-plane/v1"


def _mac(key: bytes, subject: bytes, header: bytes, payload: bytes) -> bytes:
    mac = hmac.new(key, len(subject).to_bytes(4, "big") + subject, hashlib.sha256)
    mac.update(header)
    mac.update(payload)
    return mac.digest()


class EventSealer:
    """Seals the messages of one publisher. Not thread-safe."""

    def __init__(self, secret: str) -> None:
        self._key = key_for(secret, PURPOSE)
        self._publisher_id = new_nonce()
        self._seq = 0

    def seal(self, subject: str, payload: bytes) -> bytes:
        self._seq += 1
        header = _HEADER.pack(MAGIC, self._publisher_id, self._seq, time.time())
        return header + _mac(self._key, subject.encode(), header, payload) + payload


class EventOpener:
    """Checks the messages one receiver gets; `open` returns the payload or None (dropped,
    counted in `num_rejected`; the first rejection is logged at WARNING, later ones at DEBUG).
    Remembers the last seq of at most `max_publishers` publishers."""

    def __init__(self, secret: str, *, max_age_s: float = 60.0, max_publishers: int = 4096):
        self._key = key_for(secret, PURPOSE)
        self.max_age_s, self.max_publishers = max_age_s, max_publishers
        self._last_seq: OrderedDict[bytes, int] = OrderedDict()
        self.num_rejected = 0

    def open(self, subject: str, data: bytes) -> bytes | None:
        why = self._check(subject, data)
        if why is None:
            return data[OVERHEAD_BYTES:]
        self.num_rejected += 1
        level = logging.WARNING if self.num_rejected == 1 else logging.DEBUG
        logger.log(level, "dropped an event on %s: %s (%d dropped so far)", subject, why,
                   self.num_rejected)  # fmt: skip
        return None

    def _check(self, subject: str, data: bytes) -> str | None:
        """Why `data` is not a valid message on `subject`, or None (then its seq is recorded)."""
        if len(data) < OVERHEAD_BYTES or not data.startswith(MAGIC):
            return "not sealed with the cluster secret"
        header = data[: _HEADER.size]
        _, publisher_id, seq, sent_s = _HEADER.unpack(header)
        expected = _mac(self._key, subject.encode(), header, data[OVERHEAD_BYTES:])
        if not hmac.compare_digest(expected, data[_HEADER.size : OVERHEAD_BYTES]):
            return "bad tag (forged, or another cluster's secret)"
        age_s = time.time() - sent_s
        if not abs(age_s) <= self.max_age_s:
            return f"sent {age_s:.0f}s ago (replayed?)"
        last = self._last_seq.get(publisher_id)
        if last is not None and seq <= last:
            return f"seq {seq} not after {last} (replayed)"
        self._last_seq[publisher_id] = seq
        self._last_seq.move_to_end(publisher_id)
        if len(self._last_seq) > self.max_publishers:
            self._last_seq.popitem(last=False)
        return None
