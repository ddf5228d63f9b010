"""Progress watchdog: a worker that stops making progress (frozen by SIGSTOP, wedged, its
host swapping) is treated like a dead one.

A frozen worker keeps its TCP socket and its discovery record, so nothing else notices: its
streams would wait for their deadline (600 s). `StreamWatch` bounds the wait of one stream for
its next output; `WorkerHealth` remembers which workers stalled, keeps them out of routing,
and probes them until they answer again.

Stall rule: a stream is stalled when it has waited `first_token_timeout_s` for its first output
(`stall_timeout_s` for each later one) AND its worker produced nothing on any stream of this
frontend for `stall_timeout_s`. The second half keeps a busy worker's queued requests (no first
token yet, but the worker is emitting tokens for others) from being mistaken for a frozen one.
Once one stream finds its worker stalled, the worker's other streams stop waiting at once.

A worker that left discovery while silent (its lease expired: host lost, process frozen)
needs no stall timeout: `left` ends its streams' waits at once (`WorkerLeft`, migrated like a
lost worker) and forgets it as a suspect, so when it registers again it is routed to at once.

Defaults (see `StallConfig`): 30 s to the first output, 10 s between outputs. An engine step
is milliseconds for the mocker and at most a second or two for the native engine on a CPU
(a chunked prefill step, or a decode step of a full batch); the first output may also wait
for the whole prompt's prefill and for other prompts' prefills ahead of it, which on a CPU is
tens of seconds for a burst of long prompts. The defaults sit comfortably beyond those times,
so a healthy worker is never abandoned, and still cut a frozen worker's hang from 600 s to
seconds. Deployments with faster engines lower them (`--stall-timeout-s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tandem.errors import PeerGone

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class StallConfig:
    """`first_token_timeout_s`: longest wait for a stream's first output; `stall_timeout_s`:
    for each later output, and how long a worker must be silent on every stream to count as
    stalled. 0 turns the watchdog off. `probe_interval_s`/`probe_timeout_s`: how a stalled
    worker is asked whether it answers again."""

    first_token_timeout_s: float = 30.0
    stall_timeout_s: float = 10.0
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("first_token_timeout_s", "stall_timeout_s"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name}={value} out of range; expected >= 0 (0 = off)")
        for name in ("probe_interval_s", "probe_timeout_s"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"{name}={value} out of range; expected > 0")

    @property
    def enabled(self) -> bool:
        return self.first_token_timeout_s > 0 and self.stall_timeout_s > 0


class StreamStalled(PeerGone):
    """A worker stream made no progress within the watchdog's limits (migrated like a
    broken stream)."""


class WorkerLeft(PeerGone):
    """The stream's worker left discovery while silent (migrated like a broken stream; the
    worker is not a suspect: once it registers again it is new)."""


Probe = Callable[[], Awaitable[None]]
MAX_REFUSALS = 10


class WorkerHealth:
    """Per-worker progress as this frontend sees it, and the set of stalled workers.

    `suspects` are kept out of routing until they answer again: an output on any stream, or
    a successful probe (one probe task per suspect, every `probe_interval_s`). One event
    loop; not thread-safe."""

    def __init__(self, config: StallConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self.last_output: dict[str, float] = {}  # worker_id -> time of its last output
        self._watches: dict[str, set[StreamWatch]] = {}  # worker_id -> its open streams
        self.suspects: dict[str, float] = {}  # worker_id -> time it was marked stalled
        self._probes: dict[str, asyncio.Task[None]] = {}

    # ------------------------------------------------------------ stream bookkeeping
    def stream_opened(self, worker_id: str) -> StreamWatch:
        """A watch for a new stream to `worker_id` (call from the task that reads it)."""
        watch = StreamWatch(self, worker_id)
        self._watches.setdefault(worker_id, set()).add(watch)
        self.last_output.setdefault(worker_id, self._clock())
        return watch

    def stream_closed(self, watch: StreamWatch) -> None:
        watch.close()
        watches = self._watches.get(watch.worker_id)
        if watches is not None:
            watches.discard(watch)
            if not watches:  # no stream left to judge it by: forget it (tables stay bounded)
                del self._watches[watch.worker_id]
                self.last_output.pop(watch.worker_id, None)

    def output(self, worker_id: str) -> None:
        self.last_output[worker_id] = self._clock()
        if worker_id in self.suspects:
            self.recovered(worker_id, "it streamed again")

    def worker_silent_s(self, worker_id: str) -> float:
        return self._clock() - self.last_output.get(worker_id, self._clock())

    # ------------------------------------------------------------ suspects
    def excluded(self) -> frozenset[str]:
        return frozenset(self.suspects)

    def stalled(self, worker_id: str, probe: Probe | None) -> None:
        """Mark `worker_id` stalled; `probe()` (returns once the worker answered, raises
        otherwise) is retried until it succeeds or `forget` is called."""
        if worker_id in self.suspects:
            return
        self.suspects[worker_id] = self._clock()
        logger.warning(
            "worker %s made no progress for %.1f s; no new requests until it answers",
            worker_id,
            self.worker_silent_s(worker_id),
        )
        for watch in list(self._watches.get(worker_id, ())):  # its other streams go now
            watch.fire_if_armed()
        if probe is not None:
            self._probes[worker_id] = asyncio.create_task(
                self._probe_until_healthy(worker_id, probe), name=f"probe-{worker_id}"
            )

    def left(self, worker_id: str) -> None:
        """`worker_id` left discovery and is not answering: its streams stop waiting now (and
        any later wait of theirs fires at once), and it is no longer a suspect."""
        for watch in list(self._watches.get(worker_id, ())):
            watch.gone = True
            watch.fire_if_armed()
        self.forget(worker_id)

    def forget(self, worker_id: str) -> None:
        """No longer a suspect, without a claim that it recovered (it left discovery)."""
        if self.suspects.pop(worker_id, None) is None:
            return
        task = self._probes.pop(worker_id, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    def recovered(self, worker_id: str, why: str) -> None:
        if worker_id in self.suspects:
            logger.info("worker %s is healthy again (%s)", worker_id, why)
            self.forget(worker_id)

    async def _probe_until_healthy(self, worker_id: str, probe: Probe) -> None:
        """Probe until it answers. A frozen worker times out; one that refuses at once
        `MAX_REFUSALS` times in a row is gone (its discovery record goes too), so it is
        forgotten rather than probed for ever."""
        cfg = self.config
        refusals = 0
        while worker_id in self.suspects:
            await asyncio.sleep(cfg.probe_interval_s)
            try:
                async with asyncio.timeout(cfg.probe_timeout_s):
                    await probe()
            except asyncio.CancelledError:
                raise
            except TimeoutError:
                refusals = 0
                continue
            except Exception as exc:
                refusals += 1
                logger.debug("probe of worker %s failed: %r", worker_id, exc)
                if refusals >= MAX_REFUSALS:
                    self.suspects.pop(worker_id, None)
                    self._probes.pop(worker_id, None)
                    logger.info("worker %s refuses probes; forgetting it", worker_id)
                    return
                continue
            self.recovered(worker_id, "it answered a probe")
            return

    async def close(self) -> None:
        tasks = list(self._probes.values())
        self._probes.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


class StreamWatch:
    """Cancels the task awaiting a stream's next output once the stall rule holds.

    `arm(limit_s)` before awaiting, `disarm()` after; `fired` tells the awaiting code that a
    CancelledError came from the watch (convert it with `Task.uncancel`). Armed only while
    awaiting, so a slow HTTP client never counts against the worker. `close()` at the end.

    Cheap per output: arming sets a few fields; one timer per stream, created when none is
    pending, re-checks at its due time and moves itself on if the stream progressed (a
    call_at + cancel per token would cost more than the rest of the watchdog)."""

    __slots__ = (
        "_awaiting",
        "_due",
        "_handle",
        "_health",
        "_limit_s",
        "_loop",
        "_since",
        "_task",
        "fired",
        "gone",
        "worker_id",
    )

    def __init__(self, health: WorkerHealth, worker_id: str) -> None:
        self._health, self.worker_id = health, worker_id
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None, "StreamWatch needs a task"
        self._task = task
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._awaiting = False
        self._since = 0.0  # when the current wait began
        self._limit_s = 0.0
        self.fired = False
        self.gone = False  # its worker left discovery (WorkerHealth.left)

    @property
    def config(self) -> StallConfig:
        return self._health.config

    def arm(self, limit_s: float) -> None:
        self._awaiting, self._limit_s = True, limit_s
        self._since = now = self._loop.time()
        if self.gone or self.worker_id in self._health.suspects:  # found while we were away
            self._reschedule(now)
        elif self._handle is None or self._due > now + limit_s:  # none, or a shorter limit
            self._reschedule(now + limit_s)

    def disarm(self) -> None:
        self._awaiting = False

    def close(self) -> None:
        self._awaiting = False
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def fire_if_armed(self) -> None:
        """The worker was found stalled by another stream: stop waiting for it now."""
        if self._awaiting:
            self._fire()

    def _reschedule(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self._loop.call_at(when, self._check)
        self._due = when  # the handle's when(), without a call per token

    def _check(self) -> None:
        self._handle = None
        if not self._awaiting:  # the next arm() schedules a new check
            return
        now = self._loop.time()
        health = self._health
        if not self.gone and self.worker_id not in health.suspects:
            if now < self._since + self._limit_s:  # it progressed since this timer was set
                self._reschedule(self._since + self._limit_s)
                return
            quiet_s = health.config.stall_timeout_s
            silent_s = health.worker_silent_s(self.worker_id)
            if silent_s < quiet_s:  # the worker is busy with other streams: wait on
                self._reschedule(now + quiet_s - silent_s)
                return
        self._fire()

    def _fire(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._awaiting = False
        self.fired = True
        self._task.cancel()
