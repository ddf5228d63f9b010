"""`ResponseStore`: LRU by count and by bytes, TTL from the last use, oversize entries refused,
integrity after every change."""

from __future__ import annotations

import argparse

import pytest

from tandem.frontend.api.responses.store import (
    ResponseStore,
    ResponseStoreConfig,
    add_response_store_args,
    response_store_config_from_args,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _msgs(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_count_limit_evicts_the_least_recently_used() -> None:
    store = ResponseStore(ResponseStoreConfig(max_entries=2), clock=Clock())
    assert store.put("a", b"{}", _msgs("1")) and store.put("b", b"{}", _msgs("2"))
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", b"{}", _msgs("3"))
    store.check_integrity()
    assert store.get("b") is None
    assert store.get("a") is not None and store.get("c") is not None
    assert len(store) == 2


def test_byte_limit_evicts_until_the_new_entry_fits_and_refuses_an_oversize_one() -> None:
    store = ResponseStore(ResponseStoreConfig(max_bytes=1000), clock=Clock())
    store.put("a", b"x" * 400, _msgs(""))
    store.put("b", b"x" * 400, _msgs(""))
    store.check_integrity()
    store.put("c", b"x" * 400, _msgs(""))  # a must go: 3 x 416 > 1000
    store.check_integrity()
    assert store.get("a") is None and store.get("b") is not None
    assert store.num_bytes <= 1000
    assert not store.put("huge", b"x" * 2000, _msgs(""))
    assert store.get("huge") is None and store.get("b") is not None
    store.check_integrity()


def test_entries_expire_ttl_after_their_last_use() -> None:
    clock = Clock()
    store = ResponseStore(ResponseStoreConfig(ttl_s=10), clock=clock)
    store.put("a", b"{}", _msgs("1"))
    store.put("b", b"{}", _msgs("2"))
    clock.now = 8
    assert store.get("a") is not None  # refreshed: lives until 18
    clock.now = 12
    assert store.get("b") is None
    assert store.get("a") is not None
    clock.now = 30
    assert store.get("a") is None
    assert len(store) == 0 and store.num_bytes == 0
    store.check_integrity()


def test_replace_and_delete_keep_the_byte_count() -> None:
    store = ResponseStore(clock=Clock())
    store.put("a", b"x" * 100, _msgs("hello"))
    store.put("a", b"x" * 10, _msgs("hi"))
    store.check_integrity()
    entry = store.get("a")
    assert entry is not None and entry.body == b"x" * 10 and entry.messages == _msgs("hi")
    assert store.delete("a") and not store.delete("a")
    assert store.num_bytes == 0
    store.check_integrity()


@pytest.mark.parametrize(
    "kw", [{"max_entries": 0}, {"max_bytes": 0}, {"ttl_s": 0}, {"ttl_s": -1.0}]
)
def test_config_rejects_out_of_range_limits(kw: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kw))):
        ResponseStoreConfig(**kw)


def test_flags_set_the_limits() -> None:
    parser = argparse.ArgumentParser()
    add_response_store_args(parser)
    ns = parser.parse_args(
        ["--responses-store-max-entries", "7", "--responses-store-max-mb", "0.5",
         "--responses-store-ttl-s", "60"]
    )  # fmt: skip
    config = response_store_config_from_args(ns)
    assert config == ResponseStoreConfig(max_entries=7, max_bytes=512 << 10, ttl_s=60.0)
    assert response_store_config_from_args(parser.parse_args([])) == ResponseStoreConfig()
