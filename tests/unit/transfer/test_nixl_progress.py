"""`idle_progress`: agents started inside it get the idle delay; NIXL's bindings are put back."""

from __future__ import annotations

import types
from typing import Any

import pytest

from tandem.transfer.nixl_progress import PROGRESS_DELAY_US, idle_progress

pytestmark = pytest.mark.timeout(10)


class _Bindings:
    """Stands in for NIXL's compiled bindings: records the config each agent got."""

    version = "1.5"

    def nixlAgent(self, name: str, config: Any) -> tuple[str, int]:
        return name, config.pthrDelay


def _api() -> Any:
    return types.SimpleNamespace(nixlBind=_Bindings())  # as nixl._api holds them


def test_an_agent_started_inside_gets_the_idle_delay_and_the_bindings_come_back() -> None:
    api = _api()
    original = api.nixlBind
    with idle_progress(api):
        config = types.SimpleNamespace(pthrDelay=0)
        assert api.nixlBind.nixlAgent("a", config) == ("a", PROGRESS_DELAY_US)
        assert api.nixlBind.version == "1.5"  # the rest passes through
    assert api.nixlBind is original
    assert api.nixlBind.nixlAgent("b", types.SimpleNamespace(pthrDelay=0)) == ("b", 0)


def test_the_bindings_come_back_when_the_agent_fails_to_start() -> None:
    api = _api()
    original = api.nixlBind
    with pytest.raises(RuntimeError), idle_progress(api):
        raise RuntimeError("UCX failed")
    assert api.nixlBind is original
