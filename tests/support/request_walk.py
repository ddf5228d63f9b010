"""The files a newcomer walks through for one aggregated, streamed chat completion.

`python -m tests.support.request_walk` (from the repository root) starts a frontend and a
mocker worker in one process (memory discovery and events, the TCP request plane; the SmolLM2
tokenizer and chat template), sends one warm-up chat, then records one streamed
`/v1/chat/completions` request — from its HTTP bytes reaching the frontend's socket to the SSE
`[DONE]` leaving it — and prints the `src/tandem` files whose code ran on behalf of it, marking
those the frontend's half entered (F) and those only the worker's half did (W: under the
request plane's server or an engine).

"On behalf of the request" is: Python calls made by event-loop callbacks outside any task (the
protocols' `data_received`: the frontend's HTTP socket, the request plane's sockets) and in the
tasks created while the request is in flight (its handler, its stream, the worker's stream and
the engine's step for it). Calls in tasks that already ran before the request (periodic loops:
load metrics, KV events, heartbeats, the watchdog) are the background; a window of the same
length with no request is recorded too, and whatever runs there is subtracted and listed, so
nothing is hidden. One blind spot, by this rule: an engine's step loop is a task older than
the request, so the work it does for the request in its steps is not counted (the engine's
files appear where the request's own tasks call them). The walk counts files, in the order
first entered, and how often each is entered (a call from another file).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import tandem

SRC = str(Path(tandem.__file__).resolve().parent.parent) + "/"
BODY = {
    "model": "smollm2",
    "messages": [{"role": "user", "content": "Name the capital of France."}],
    "max_tokens": 8,
    "stream": True,
}


@dataclass
class Walk:
    """What one recorded window ran: files in first-entry order, entries per file, and the
    files the frontend's half entered (the rest ran only in the worker's half)."""

    order: list[str] = field(default_factory=list)
    entries: Counter[str] = field(default_factory=Counter)
    frontend: set[str] = field(default_factory=set)


WORKER_SIDE = ("tandem/runtime/tcp/server.py", "tandem/engines/")


def _worker_side(frame: FrameType | None) -> bool:
    """Whether `frame` runs in the worker's half: under the request plane's server or an
    engine. Everything else in the window is the frontend's half."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(SRC) and name[len(SRC) :].startswith(WORKER_SIDE):
            return True
        frame = frame.f_back
    return False


class _Recorder:
    def __init__(self, old_tasks: set[asyncio.Task[Any]]) -> None:
        self.old_tasks, self.walk = old_tasks, Walk()

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(SRC):
            return
        try:
            task = asyncio.current_task()
        except RuntimeError:
            task = None
        if task is not None and task in self.old_tasks:
            return  # a loop that ran before the request: background
        name = path[len(SRC) :]
        if name not in self.walk.entries:
            self.walk.order.append(name)
            self.walk.entries[name] = 0
        caller = frame.f_back
        if caller is None or caller.f_code.co_filename != path:
            self.walk.entries[name] += 1  # entered from another file
        if name not in self.walk.frontend and not _worker_side(frame):
            self.walk.frontend.add(name)


async def _record(action: Any) -> Walk:
    recorder = _Recorder(set(asyncio.all_tasks()))
    sys.setprofile(recorder)
    try:
        await action()
    finally:
        sys.setprofile(None)
    return recorder.walk


async def walk_one_chat() -> tuple[Walk, Walk]:
    """(the request's walk, what ran in an idle window of the same length)."""
    from tandem.engines.mocker.config import MockerConfig
    from tandem.engines.mocker.engine import MockerEngine
    from tests.support.frontend_stack import CHAT, FrontendStack
    from tests.support.smollm2 import smollm2_gguf

    async with AsyncExitStack() as stack:
        s = FrontendStack(stack)
        config = MockerConfig(
            num_blocks=256, block_size=16, speedup_ratio=0, tokenizer=f"gguf:{smollm2_gguf()}"
        )
        await s.add_worker(MockerEngine(config))
        await s.start_frontend({**BODY, "stream": False})
        assert (await s.post(CHAT, BODY))[0] == 200  # warm: caches, pooled connections

        async def one_chat() -> None:
            status, text, _ = await s.post(CHAT, BODY)
            assert status == 200 and "[DONE]" in text, (status, text)

        start = time.monotonic()
        request = await _record(one_chat)
        length = time.monotonic() - start
        idle = await _record(lambda: asyncio.sleep(length))
    return request, idle


def request_path(request: Walk, idle: Walk) -> tuple[list[str], list[str]]:
    """(the request's files, those of them the frontend's half entered): what ran for the
    request and not in the idle window, in first-entry order."""
    path = [f for f in request.order if f not in idle.entries]
    return path, [f for f in path if f in request.frontend]


def main() -> None:
    request, idle = asyncio.run(walk_one_chat())
    path, front = request_path(request, idle)
    print(f"request path: {len(path)} files, {len(front)} in the frontend's half (F)")
    for name in path:
        side = "F" if name in request.frontend else "W"
        print(f"  {request.entries[name]:3d}  {side}  {name}")
    print(f"background (also ran with no request): {len(idle.order)} files")
    for name in idle.order:
        print(f"       {name}")
    print(json.dumps({"files": len(path), "frontend_files": len(front)}))


if __name__ == "__main__":
    main()
