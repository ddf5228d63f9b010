"""Authenticated event-plane messages: an HMAC tag per message, keyed by the cluster secret.

Why a tag per message rather than ZMQ CURVE: the same envelope works on every backend (ZMQ
is brokerless, NATS has a broker that may run without auth), it needs no key distribution
beyond the secret every process already holds, and a receiver can drop a forged message
without trusting the connection it came on.

Secrecy: KV events carry prompt token ids, and whoever can subscribe on the NATS server would
read them (and so the prompts), so the NATS bus seals with `encrypt=True`: the payload is
encrypted with AES-256-GCM under a key of the publisher's own (HMAC of the plane's encryption
key and its publisher id; the nonce is the message's seq, unique per publisher key). ZMQ keeps
version 1: its sockets are already CURVE-encrypted with keys from the same secret (`curve.py`).

Wire layouts, header = magic | publisher_id (16 bytes) | seq (u64) | time_s (f64):
- version 1, b"TEV1": header | tag (32 bytes) | payload, tag = HMAC(key, subject, header,
  payload);
- version 2, b"TEV2": header | AES-GCM(publisher key, nonce = seq, payload, associated data =
  subject, header), i.e. ciphertext then its 16-byte tag.
A receiver accepts both; it drops a message whose tag does not verify, that is older than
`max_age_s`, or whose seq is not above the last one it saw from that publisher (a replay).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
import time
from collections import OrderedDict

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tandem.runtime.secret import key_for, new_nonce

logger = logging.getLogger(__name__)
MAGIC = b"TEV1"
MAGIC_ENCRYPTED = b"TEV2"
_HEADER = struct.Struct(">4s16sQd")
_TAG_BYTES = 32
_AEAD_TAG_BYTES = 16
OVERHEAD_BYTES = _HEADER.size + _TAG_BYTES
PURPOSE = "event-plane/v1"
ENCRYPTION_PURPOSE = "event-plane-encryption/v2"


def _publisher_cipher(key: bytes, publisher_id: bytes) -> AESGCM:
    return AESGCM(hmac.new(key, publisher_id, hashlib.sha256).digest())


def _nonce(seq: int) -> bytes:
    return seq.to_bytes(12, "big")


def _aad(subject: bytes, header: bytes) -> bytes:
    return len(subject).to_bytes(4, "big") + subject + header


def _mac(key: bytes, subject: bytes, header: bytes, payload: bytes) -> bytes:
    mac = hmac.new(key, len(subject).to_bytes(4, "big") + subject, hashlib.sha256)
    mac.update(header)
    mac.update(payload)
    return mac.digest()


class EventSealer:
    """Seals the messages of one publisher: tagged (version 1) or, with `encrypt`, encrypted
    and tagged (version 2). Not thread-safe."""

    def __init__(self, secret: str, *, encrypt: bool = False) -> None:
        self._key = key_for(secret, PURPOSE)
        self._publisher_id = new_nonce()
        self._seq = 0
        self._cipher = (
            _publisher_cipher(key_for(secret, ENCRYPTION_PURPOSE), self._publisher_id)
            if encrypt
            else None
        )

    def seal(self, subject: str, payload: bytes) -> bytes:
        self._seq += 1
        if self._cipher is not None:
            header = _HEADER.pack(MAGIC_ENCRYPTED, self._publisher_id, self._seq, time.time())
            aad = _aad(subject.encode(), header)
            return header + self._cipher.encrypt(_nonce(self._seq), payload, aad)
        header = _HEADER.pack(MAGIC, self._publisher_id, self._seq, time.time())
        return header + _mac(self._key, subject.encode(), header, payload) + payload


class EventOpener:
    """Checks the messages one receiver gets; `open` returns the payload or None (dropped,
    counted in `num_rejected`; the first rejection is logged at WARNING, later ones at DEBUG).
    Remembers the last seq of at most `max_publishers` publishers."""

    def __init__(self, secret: str, *, max_age_s: float = 60.0, max_publishers: int = 4096):
        self._key = key_for(secret, PURPOSE)
        self._encryption_key = key_for(secret, ENCRYPTION_PURPOSE)
        self.max_age_s, self.max_publishers = max_age_s, max_publishers
        self._last_seq: OrderedDict[bytes, int] = OrderedDict()
        self._ciphers: OrderedDict[bytes, AESGCM] = OrderedDict()
        self.num_rejected = 0

    def open(self, subject: str, data: bytes) -> bytes | None:
        if data.startswith(MAGIC_ENCRYPTED):
            why, payload = self._decrypt(subject, data)
        else:
            why, payload = self._check(subject, data), data[OVERHEAD_BYTES:]
        if why is None:
            return payload
        self.num_rejected += 1
        level = logging.WARNING if self.num_rejected == 1 else logging.DEBUG
        logger.log(level, "dropped an event on %s: %s (%d dropped so far)", subject, why,
                   self.num_rejected)  # fmt: skip
        return None

    def _decrypt(self, subject: str, data: bytes) -> tuple[str | None, bytes]:
        """(why `data` is not a valid version-2 message, or None; its payload)."""
        if len(data) < _HEADER.size + _AEAD_TAG_BYTES:
            return "not sealed with the cluster secret", b""
        header = data[: _HEADER.size]
        _, publisher_id, seq, sent_s = _HEADER.unpack(header)
        cipher = self._ciphers.get(publisher_id)
        if cipher is None:
            cipher = _publisher_cipher(self._encryption_key, publisher_id)
        aad = _aad(subject.encode(), header)
        try:
            payload = cipher.decrypt(_nonce(seq), data[_HEADER.size :], aad)
        except InvalidTag:
            return "bad tag (forged, or another cluster's secret)", b""
        self._ciphers[publisher_id] = cipher
        self._ciphers.move_to_end(publisher_id)
        if len(self._ciphers) > self.max_publishers:
            self._ciphers.popitem(last=False)
        return self._check_fresh(publisher_id, seq, sent_s), payload

    def _check(self, subject: str, data: bytes) -> str | None:
        """Why `data` is not a valid message on `subject`, or None (then its seq is recorded)."""
        if len(data) < OVERHEAD_BYTES or not data.startswith(MAGIC):
            return "not sealed with the cluster secret"
        header = data[: _HEADER.size]
        _, publisher_id, seq, sent_s = _HEADER.unpack(header)
        expected = _mac(self._key, subject.encode(), header, data[OVERHEAD_BYTES:])
        if not hmac.compare_digest(expected, data[_HEADER.size : OVERHEAD_BYTES]):
            return "bad tag (forged, or another cluster's secret)"
        return self._check_fresh(publisher_id, seq, sent_s)

    def _check_fresh(self, publisher_id: bytes, seq: int, sent_s: float) -> str | None:
        """Why an authentic message is stale or replayed, or None (its seq is recorded)."""
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
