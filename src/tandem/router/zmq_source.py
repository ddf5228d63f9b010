"""`ZmqEngineSource`: reads one unmodified engine's ZMQ KV events (vLLM/SGLang format, see
`engine_events`) into an `EventApplier`, replaying missed sequence numbers from the engine's
replay socket when one is configured."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from tandem.router.engine_events import decode_engine_batch, to_tandem_batch
from tandem.router.event_applier import EventApplier
from tandem.router.indexer import WorkerKey

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ZmqEndpoint:
    worker_id: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""

    @classmethod
    def parse(cls, spec: str) -> ZmqEndpoint:
        """`worker_id=tcp://host:port[|tcp://host:replay_port]`."""
        worker_id, _, rest = spec.partition("=")
        endpoint, _, replay = rest.partition("|")
        if not worker_id or not endpoint:
            raise ValueError(
                f"ZMQ endpoint {spec!r} malformed; expected 'worker_id=tcp://h:p[|tcp://h:q]'"
            )
        return cls(worker_id, endpoint, replay or None)


class ZmqEngineSource:
    """One SUB socket per engine. `start` connects, `close` stops; one event loop."""

    def __init__(
        self, spec: ZmqEndpoint, applier: EventApplier, *, replay_timeout_s: float = 2.0
    ) -> None:
        self.spec = spec
        self.applier = applier
        self._timeout_s = replay_timeout_s
        self._ctx = zmq.asyncio.Context.instance()
        self._task: asyncio.Task[None] | None = None
        self.num_batches = 0

    async def start(self) -> None:
        # an engine cannot send its whole block set: its first batch is the baseline
        self.applier.synced.add(self.spec.worker_id)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.spec.topic)
        sub.connect(self.spec.endpoint)
        self._task = asyncio.create_task(self._read(sub), name=f"zmq-kv:{self.spec.worker_id}")

    async def _read(self, sub: zmq.asyncio.Socket) -> None:
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    self.applier.metrics.events[("batch", "malformed")] += 1
                    continue
                _topic, seq_bytes, payload = frames
                await self.on_message(int.from_bytes(seq_bytes, "big"), payload)
        finally:
            sub.close(linger=0)

    async def on_message(self, seq: int, payload: bytes) -> None:
        if self._apply(seq, payload, force=False) != "gap":
            return
        last = self.applier.last_event_id.get(self._key(payload), seq - 1)
        if self.spec.replay_endpoint is not None:
            try:
                await asyncio.wait_for(self._replay(last + 1, seq), self._timeout_s)
            except (TimeoutError, zmq.ZMQError) as exc:
                logger.warning("replay from %s failed: %r", self.spec.replay_endpoint, exc)
        if self._apply(seq, payload, force=False) == "gap":
            self.applier.metrics.events[("batch", "gap_unrecovered")] += 1
            self._apply(seq, payload, force=True)  # accept the loss; stay current

    def _key(self, payload: bytes) -> WorkerKey:
        rank = decode_engine_batch(payload).data_parallel_rank or 0
        return WorkerKey(self.spec.worker_id, rank)

    def _apply(self, seq: int, payload: bytes, *, force: bool) -> str:
        try:
            engine_batch = decode_engine_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.applier.metrics.events[("batch", "malformed")] += 1
            logger.warning("dropping malformed engine KV batch seq=%d: %s", seq, exc)
            return "malformed"
        batch = to_tandem_batch(
            engine_batch, worker_id=self.spec.worker_id, seq=seq, indexer=self.applier.indexer
        )
        self.num_batches += 1
        if force:
            key = self._key(payload)
            self.applier.last_event_id[key] = seq - 1
        return self.applier.apply(batch)

    async def _replay(self, first_seq: int, until_seq: int) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.spec.replay_endpoint)  # type: ignore[arg-type]
        try:
            await sock.send_multipart([b"", first_seq.to_bytes(8, "big")])
            while True:
                frames = await sock.recv_multipart()
                seq_bytes, payload = frames[-2], frames[-1]
                if not payload:
                    return
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq >= until_seq:
                    return
                self._apply(seq, payload, force=False)
        finally:
            sock.close(linger=0)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:
                logger.debug("ZMQ source ended with an error", exc_info=True)
            self._task = None
