"""The HTTP server's tests run on both event loops: asyncio's (the tests' default) and uvloop
(what the frontend process runs)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest
import uvloop

BOTH_LOOPS = "test_frontend_http_server.py"
# patches a transport method, which uvloop's (Cython) transports do not allow
ASYNCIO_ONLY = {"test_writes_of_one_loop_iteration_leave_in_one_send"}


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    if item.path.name == BOTH_LOOPS and item.name.split("[")[0] not in ASYNCIO_ONLY:
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}
