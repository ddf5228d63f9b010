"""`BatchRunner`: runs the lines of every batch this frontend holds, through the same
handlers as online requests, at the lowest priority class, in the fleet's idle capacity.

- Leases (`BatchStore.claim`): a runner holds the batches it runs and renews them each tick;
  a batch whose runner died (or a frontend restarted) is taken over when its lease lapses, a
  cleanly stopped runner releases at once. Its pending lines (and those that were in flight)
  run again: a line is done only once its answer is written.
- Idle capacity: at most `max_inflight` lines in flight, and no line starts while `busy()`
  (a model's router has requests queued: interactive traffic waits, so the lane yields).
- A line whose request fails retryably (429, 5xx: no worker, a worker lost beyond migration)
  runs again after a back-off, up to `max_attempts`; any other answer is final: 200 goes to
  the output file, an error to the error file.
- Cancel: a `cancelling` batch's lines in flight are cancelled, then it ends `cancelled` with
  what finished; past `expires_at` a batch ends `expired`, its unrun lines in the error file
  (`batch_expired`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable

from tandem.frontend.batch.batches import error_line
from tandem.frontend.batch.config import BatchConfig
from tandem.frontend.batch.files import new_file_id
from tandem.frontend.batch.store import BatchStore, FileRow, LineRow

logger = logging.getLogger(__name__)

# url, JSON body, owner, request id -> (HTTP status, response body)
Execute = Callable[[str, bytes, str, str], Awaitable[tuple[int, bytes]]]
RETRYABLE = frozenset({408, 429, 500, 502, 503, 504})


class BatchRunner:
    """One per frontend; one event loop. `start()` once, `close()` at shutdown."""

    def __init__(
        self,
        store: BatchStore,
        config: BatchConfig,
        execute: Execute,
        busy: Callable[[], bool] = lambda: False,
    ) -> None:
        self.store, self.config, self.execute, self.busy = store, config, execute, busy
        self.runner_id = f"runner-{secrets.token_hex(6)}"
        self._wake = asyncio.Event()
        self._inflight: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self.num_retries = 0

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="batch-runner")

    def wake(self) -> None:
        self._wake.set()

    async def close(self) -> None:
        """Stop: cancel the loop and the lines in flight (they stay pending), release leases."""
        tasks = [t for t in (self._task, *self._inflight.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(self.store.release, self.runner_id)

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("batch runner tick failed; retrying")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.poll_s)

    async def tick(self) -> None:
        """Renew leases, start lines where there is room, end batches that are done."""
        held = await asyncio.to_thread(self.store.claim, self.runner_id, self.config.lease_s)
        for batch_id, status, _owner in held:
            batch = await asyncio.to_thread(self.store.batch, batch_id, None)
            if batch is None:
                continue
            mine = {idx for (b, idx) in self._inflight if b == batch_id}
            if status == "cancelling":
                for (b, _), task in list(self._inflight.items()):
                    if b == batch_id:
                        task.cancel()
                if not mine:
                    await self._finish(batch_id, "cancelled")
                continue
            if time.time() >= batch["expires_at"]:
                await self._finish(batch_id, "expired")
                continue
            if status == "validating":  # its lines were checked at create; a runner has it now
                await asyncio.to_thread(self.store.begin, batch_id, int(time.time()))
            room = self.config.max_inflight - len(self._inflight)
            lines: list[LineRow] = []
            if room > 0 and not self.busy():
                lines = await asyncio.to_thread(self.store.pending_lines, batch_id, mine, room)
            for line in lines:
                key = (batch_id, line.idx)
                self._inflight[key] = asyncio.create_task(self._run(batch["endpoint"], line))
                self._inflight[key].add_done_callback(functools.partial(self._done, key))
            if not lines and not mine and (
                status == "finalizing" or not await asyncio.to_thread(
                    self.store.pending_lines, batch_id, set(), 1)
            ):  # fmt: skip
                await self._finish(batch_id, "completed")

    def _done(self, key: tuple[str, int], _task: asyncio.Task[None]) -> None:
        self._inflight.pop(key, None)
        self._wake.set()

    async def _run(self, endpoint: str, line: LineRow) -> None:
        assert line.body is not None
        owner = await asyncio.to_thread(self.store.owner_of, line.batch_id) or ""
        request_id = f"batch_req_{secrets.token_hex(12)}"
        status, body = 500, b""
        for attempt in range(self.config.max_attempts):
            try:
                status, body = await self.execute(endpoint, line.body, owner, request_id)
            except Exception as exc:  # a request boundary: the line is retried, then failed
                logger.warning("batch %s line %d failed: %r", line.batch_id, line.idx, exc)
                status = 500
                error = {"error": {"message": str(exc), "type": "internal_error"}}
                body = json.dumps(error).encode()
            if status not in RETRYABLE or attempt == self.config.max_attempts - 1:
                break
            self.num_retries += 1
            await asyncio.sleep(min(0.1 * 2**attempt, 5.0))
        result = {"id": request_id, "custom_id": line.custom_id,
                  "response": {"status_code": status, "request_id": request_id,
                               "body": json.loads(body) if body else None},
                  "error": None}  # fmt: skip
        await asyncio.to_thread(
            self.store.finish_line, line.batch_id, line.idx, ok=status == 200,
            result=json.dumps(result).encode(),
        )  # fmt: skip

    async def _finish(self, batch_id: str, status: str) -> None:
        """Write the output and error files and end the batch as `status`."""
        now = int(time.time())
        await asyncio.to_thread(self.store.update, batch_id, "finalizing", finalizing_at=now)
        if status == "expired":
            for idx, custom_id in await asyncio.to_thread(self.store.pending_custom_ids, batch_id):
                line = error_line(custom_id, "batch_expired",
                                  "the batch expired before this request ran")  # fmt: skip
                await asyncio.to_thread(
                    self.store.finish_line, batch_id, idx, ok=False, result=line
                )
        owner = await asyncio.to_thread(self.store.owner_of, batch_id) or ""
        ids: dict[str, str | None] = {}
        for state, field in (("done", "output_file_id"), ("failed", "error_file_id")):
            results = await asyncio.to_thread(self.store.results, batch_id, state)
            ids[field] = None
            if results:
                content = b"\n".join(results) + b"\n"
                name = f"{batch_id}_{'output' if state == 'done' else 'error'}.jsonl"
                row = FileRow(new_file_id(), owner, "batch_output", name, len(content), now)
                await asyncio.to_thread(self.store.add_file, row, content)
                ids[field] = row.id
        stamp = {"completed": "completed_at", "cancelled": "cancelled_at",
                 "expired": "expired_at"}[status]  # fmt: skip
        await asyncio.to_thread(
            self.store.update, batch_id, status, **ids, **{stamp: int(time.time())}
        )
        logger.info("batch %s %s", batch_id, status)
