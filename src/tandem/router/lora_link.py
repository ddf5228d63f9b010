"""A router's links to its workers about LoRA adapters: their `LoraEvent`s in
(`follow_lora_events`, into router/lora.py's residency), and asks to unload a cold adapter out
(`ColdUnloads`, over the request plane, one task per ask). Only requests routed with an adapter
reach the asks; a failed ask (the worker is gone, or busy) only costs the slot until its LRU
evicts it."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from tandem.protocols.discovery import Instance
from tandem.protocols.lora import UNLOAD_ENDPOINT, LoraEvent, LoraUnloadRequest, encode
from tandem.router.lora import LoraPlacement
from tandem.router.source import InstanceSource
from tandem.runtime.base import RequestClient, Subscription

logger = logging.getLogger(__name__)
_lora_event = msgspec.msgpack.Decoder(LoraEvent)


async def follow_lora_events(
    sub: Subscription, placement: LoraPlacement, source: InstanceSource
) -> None:
    """Apply the workers' LoraEvents from `sub` to `placement` (an event of a worker not live
    in `source` now is stale; a malformed one is dropped, logged); closes `sub` at the end."""
    try:
        async for subject, payload in sub:
            try:
                event = _lora_event.decode(payload)
            except msgspec.MsgspecError:
                logger.warning("malformed LoRA event on %s dropped", subject)
                continue
            if event.worker_id in source.instances:
                placement.apply_event(event)
    finally:
        await sub.close()


ASK_TIMEOUT_S = 5.0


class ColdUnloads:
    """The unload asks in flight; `cancel_all` at the router's close."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def ask(self, client: RequestClient, instance: Instance, subject: str, name: str) -> None:
        """Ask `instance` (its endpoint `subject`'s unload sibling) to unload `name`, in a
        task; nothing without a running loop (a synchronous caller)."""
        worker_id = instance.instance_id
        path = f"{subject}.{UNLOAD_ENDPOINT}"

        async def unload() -> None:
            try:
                async for _ in client.stream(
                    instance.address,
                    path,
                    encode(LoraUnloadRequest(name=name)),
                    request_id=f"lora-unload-{name}-{worker_id}"[:128],
                    deadline_s=time.time() + ASK_TIMEOUT_S,
                ):
                    pass
            except Exception as exc:  # task boundary: the adapter just stays until its LRU
                logger.debug("unloading cold LoRA adapter %s on worker_id=%s: %s", name,
                             worker_id, exc)  # fmt: skip

        try:
            task = asyncio.get_running_loop().create_task(unload(), name="router-lora-unload")
        except RuntimeError:
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
