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
