"""Sealed event payloads: only messages sealed with this cluster's secret, on the subject they
were sealed for, once, and recently, are opened."""

from __future__ import annotations

import logging
import secrets

import pytest

from tandem.runtime.events import envelope
from tandem.runtime.events.envelope import EventOpener, EventSealer

SECRET = secrets.token_hex(32)  # as `openssl rand -hex 32` makes one


def test_sealed_message_opens_once() -> None:
    sealer, opener = EventSealer(SECRET), EventOpener(SECRET)
    first, second = sealer.seal("t.kv.w1", b"a"), sealer.seal("t.kv.w1", b"b")
    assert opener.open("t.kv.w1", first) == b"a"
    assert opener.open("t.kv.w1", second) == b"b"
    assert opener.open("t.kv.w1", first) is None  # replayed
    assert opener.num_rejected == 1


@pytest.mark.parametrize(
    "forge",
    [
        lambda: (b"t.kv.w1", b"plain payload"),
        lambda: (b"t.kv.w1", EventSealer("another-secret-0123456789").seal("t.kv.w1", b"x")),
        lambda: (b"t.kv.w1", EventSealer(SECRET).seal("t.load.w1", b"x")),  # other subject
        lambda: (b"t.kv.w1", EventSealer(SECRET).seal("t.kv.w1", b"x")[:-1] + b"y"),  # altered
        lambda: (b"t.kv.w1", b""),
    ],
    ids=["unsealed", "other-secret", "other-subject", "altered", "empty"],
)
def test_forged_message_is_dropped_and_first_drop_logged(forge, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="tandem.runtime.events.envelope")
    opener = EventOpener(SECRET)
    subject, data = forge()
    assert opener.open(subject.decode(), data) is None
    assert opener.open(subject.decode(), data) is None
    assert opener.num_rejected == 2
    assert [r.levelname for r in caplog.records] == ["WARNING", "DEBUG"]


def test_stale_message_is_dropped(monkeypatch) -> None:
    sealer, opener = EventSealer(SECRET), EventOpener(SECRET, max_age_s=60)
    now = envelope.time.time()
    monkeypatch.setattr(envelope.time, "time", lambda: now - 120)
    old = sealer.seal("t.kv.w1", b"old")
    monkeypatch.setattr(envelope.time, "time", lambda: now)
    assert opener.open("t.kv.w1", old) is None


def test_remembers_a_bounded_number_of_publishers() -> None:
    opener = EventOpener(SECRET, max_publishers=3)
    for _ in range(10):
        assert opener.open("s", EventSealer(SECRET).seal("s", b"x")) == b"x"
    assert len(opener._last_seq) == 3


def test_encrypted_message_hides_its_payload_and_opens_once() -> None:
    sealer, opener = EventSealer(SECRET, encrypt=True), EventOpener(SECRET)
    payload = b"token_ids: 101 102 103 " * 8
    first, second = sealer.seal("t.kv.w1", payload), sealer.seal("t.kv.w1", payload)
    assert first.startswith(envelope.MAGIC_ENCRYPTED)
    assert b"token_ids" not in first and first[-len(payload) :] != payload
    assert first[envelope._HEADER.size :] != second[envelope._HEADER.size :]  # nonce = seq
    assert opener.open("t.kv.w1", first) == payload
    assert opener.open("t.kv.w1", second) == payload
    assert opener.open("t.kv.w1", first) is None  # replayed
    assert opener.num_rejected == 1


@pytest.mark.parametrize(
    "forge",
    [
        lambda s: EventSealer(secrets.token_hex(32), encrypt=True).seal("t.kv.w1", b"x"),
        lambda s: EventSealer(SECRET, encrypt=True).seal("t.load.w1", b"x"),  # other subject
        lambda s: s[:-1] + bytes([s[-1] ^ 1]),  # ciphertext altered
        lambda s: s[:20] + bytes([s[20] ^ 1]) + s[21:],  # publisher id altered
        lambda s: s[: envelope._HEADER.size + 3],  # truncated
    ],
    ids=["other-secret", "other-subject", "altered", "other-publisher", "truncated"],
)
def test_forged_encrypted_message_is_dropped(forge) -> None:
    sealed = EventSealer(SECRET, encrypt=True).seal("t.kv.w1", b"payload")
    opener = EventOpener(SECRET)
    assert opener.open("t.kv.w1", forge(sealed)) is None
    assert opener.num_rejected == 1
