from __future__ import annotations

import gc

import pytest

from tandem.frontend.models import GC_YOUNG_THRESHOLD, freeze_long_lived

pytestmark = pytest.mark.timeout(10)


def test_freeze_long_lived_moves_live_objects_out_of_collection() -> None:
    before = gc.get_threshold()
    kept = [[i] for i in range(1000)]  # long-lived containers, e.g. a tokenizer's tables
    try:
        freeze_long_lived()
        assert gc.get_freeze_count() >= len(kept)
        assert gc.get_threshold()[0] >= GC_YOUNG_THRESHOLD
        assert gc.get_threshold()[1:] == before[1:]
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
