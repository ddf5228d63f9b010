"""Stopping long-lived asyncio tasks at shutdown."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any] | None]) -> None:
    """Cancel every task (None entries skipped), then await each in turn.

    A task's CancelledError is swallowed; any other exception a task ended with propagates
    (the remaining tasks are then not awaited). Call from the tasks' own event loop.
    """
    pending = [task for task in tasks if task is not None]
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(asyncio.CancelledError):
            await task
