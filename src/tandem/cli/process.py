"""What every `tandem` process entry point does before its service runs: configure logging
(only entry points do; STYLE.md) and run the service coroutine on uvloop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """`coro` to completion on uvloop (plain asyncio where uvloop is missing)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(coro)
    return uvloop.run(coro)
