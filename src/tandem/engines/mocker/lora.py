"""`MockerLoras`: the mocker's simulated LoRA adapters (issue 32): residency in `--max-loras`
slots (the native engine's `LoraSlots`, LRU of idle adapters), a simulated load time, and the
requests that wait for it.

No weights are read: a load checks that the directory holds a PEFT `adapter_config.json` with
an integer rank `r` (what the answer reports), then costs `--lora-load-ms` (divided by the
speedup ratio) of the engine's step loop: a load stalls every running request of the worker, as
vLLM's does (its model runner loads an adapter between steps). A request whose adapter is
still loading waits for the load; one naming an adapter that is not resident is refused with
ModelNotFound (the Worker loads a cataloged adapter before it calls `generate`). When every
slot holds an adapter that running requests use, a load waits up to `SLOT_WAIT_S` for one to
go idle, then answers Overloaded. Unloading an adapter lets its running requests finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

from tandem.engines.lora import CONFIG_FILE, LoraSlots
from tandem.errors import InvalidRequest, Overloaded
from tandem.protocols.lora import LoraLoaded

SLOT_WAIT_S = 30.0  # how long a load waits for a slot whose adapter's requests all finish


class MockerLoras:
    """One mocker's adapters. `stall(seconds)` is the engine's: it resolves once the step loop
    has spent that long on the load; `clock` the engine's. One event loop; not thread-safe."""

    def __init__(
        self,
        max_loras: int,
        load_s: float,
        stall: Callable[[float], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self.slots: LoraSlots[tuple[str, int]] = LoraSlots(max_loras)  # name -> (path, rank)
        self.load_s = load_s
        self._stall = stall
        self._loading: dict[str, asyncio.Future[None]] = {}
        self._in_use: Counter[str] = Counter()  # running requests per adapter
        self._idle = asyncio.Event()  # set whenever a request releases an adapter
        self.num_loads = 0
        self.num_evictions = 0

    def resident(self) -> list[str]:
        """Adapters loaded now (not those still loading), least recently used first."""
        return [n for n in self.slots.names() if n not in self._loading]

    async def load(self, name: str, path: str) -> LoraLoaded:
        """Make `name` resident from `path` (idempotent for the same path; another path:
        InvalidRequest). Waits for a slot, evicting the least recently used idle adapter."""
        held = self.slots.peek(name)
        if held is not None:
            if held[0] != path:
                raise InvalidRequest(
                    f"LoRA adapter '{name}' is loaded from {held[0]}; unload it before "
                    f"loading {path} under that name"
                )
            if name in self._loading:
                await asyncio.shield(self._loading[name])
            self.slots.use(name)
            return LoraLoaded(name=name, rank=held[1], load_s=0.0)
        rank = _read_rank(Path(path), name)
        started = self._clock()
        await self._take_slot(name, (path, rank))
        done = self._loading[name] = asyncio.get_running_loop().create_future()
        try:
            await self._stall(self.load_s)
        except BaseException:
            self.slots.remove(name)
            raise
        finally:
            del self._loading[name]
            done.set_result(None)
        self.num_loads += 1
        return LoraLoaded(name=name, rank=rank, load_s=self._clock() - started)

    async def _take_slot(self, name: str, item: tuple[str, int]) -> None:
        deadline = self._clock() + SLOT_WAIT_S
        while True:
            busy = {n for n, k in self._in_use.items() if k > 0} | set(self._loading)
            try:
                self.num_evictions += len(self.slots.add(name, item, busy))
                return
            except Overloaded:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise
                self._idle.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._idle.wait(), timeout=remaining)

    def unload(self, name: str) -> None:
        """Drop `name` now (ModelNotFound when it is not resident); its running requests
        finish, new ones are refused."""
        if name in self._loading:
            raise InvalidRequest(f"LoRA adapter '{name}' is still loading; unload it after")
        self.slots.remove(name)

    async def acquire(self, name: str) -> None:
        """A request starts with adapter `name`: waits while it loads; ModelNotFound when it
        is not resident."""
        loading = self._loading.get(name)
        if loading is not None:
            await asyncio.shield(loading)
        self.slots.use(name)
        self._in_use[name] += 1

    def release(self, name: str) -> None:
        left = self._in_use[name] - 1
        if left > 0:
            self._in_use[name] = left
        else:
            del self._in_use[name]
            self._idle.set()


def _read_rank(root: Path, name: str) -> int:
    """The rank `r` of the PEFT adapter config in `root`; InvalidRequest naming the problem."""
    label = f"LoRA adapter '{name}' ({root})"
    try:
        config = json.loads((root / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise InvalidRequest(
            f"{label}: no {CONFIG_FILE}; expected a PEFT adapter directory"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"{label}: {CONFIG_FILE} is not readable JSON: {exc}") from None
    rank = config.get("r") if isinstance(config, dict) else None
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise InvalidRequest(f"{label}: r={rank!r} in {CONFIG_FILE}; expected a positive integer")
    return rank
