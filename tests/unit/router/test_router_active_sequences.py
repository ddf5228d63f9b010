from __future__ import annotations

import pytest

from tandem.router.active_sequences import ActiveSequences

pytestmark = pytest.mark.timeout(10)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_blocks_deduplicated_prefill_settled_and_freed() -> None:
    a = ActiveSequences(ttl_s=60, clock=Clock())
    a.add("r1", "w", [1, 2, 3], 48)
    a.add("r2", "w", [1, 2, 4], 16)
    a.check_integrity()
    assert a.num_active_blocks("w") == 4
    assert a.num_prefill_tokens("w") == 64
    assert a.num_new_blocks("w", [1, 5, 6]) == 2
    a.mark_prefilled("r1")
    a.mark_prefilled("r1")
    assert a.num_prefill_tokens("w") == 16
    assert a.free("r2") == "w"
    assert a.free("r2") is None
    a.check_integrity()
    assert (a.num_active_blocks("w"), a.num_prefill_tokens("w")) == (3, 0)
    a.free("r1")
    assert a.num_requests("w") == 0 and a.num_active_blocks("w") == 0
    a.check_integrity()


def test_stale_entries_swept_after_ttl() -> None:
    clock = Clock()
    a = ActiveSequences(ttl_s=10, clock=clock)
    a.add("old", "w", [1], 16)
    clock.now = 8
    a.add("new", "w", [2], 16)
    clock.now = 12
    assert a.sweep() == ["old"]
    assert "new" in a and "old" not in a
    assert a.num_prefill_tokens("w") == 16
    a.check_integrity()
