"""`TransferAgent`: one per worker process; owns registered regions and operations.

Typical use (prefill-first, pull):
    prefill: op = agent.create_readable("kv", block_ids, ttl_s=30, on_release=unpin)
             send op.meta (msgpack via `encode_meta`) to the decode worker
    decode:  agent.pull(meta, "kv", my_block_ids, timeout_s=5)   # raises TransferError

Decode-first (push): the decode creates a writable op and publishes its meta (or just
its address + op id as an `OpRef`); the prefill calls `agent.push("kv", ids, meta)`;
the decode waits with `agent.wait(op_id, timeout_s)`. Either side may come first: the
owner waits up to the initiator's timeout for an op id that does not exist yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, NamedTuple, ParamSpec, TypedDict, TypeVar, Unpack

import msgspec
from prometheus_client.metrics_core import Metric

from tandem.errors import TransferError
from tandem.transfer.base import TransferBackend
from tandem.transfer.client import cancel_soon, run_transfer, send_control, send_export
from tandem.transfer.config import TransferAgentConfig
from tandem.transfer.descriptor import OpKind, OpRef, OpStatus, RegionLayout, TransferOpMeta
from tandem.transfer.metrics import TransferStats, transfer_families
from tandem.transfer.operation import ReleaseCallback, TransferOp
from tandem.transfer.pool import ConnectionPool
from tandem.transfer.region import (
    MemoryRegion,
    as_bytes,
    create_shm_region,
    sweep_stale_segments,
)
from tandem.transfer.registry import create_backends, installed_backends
from tandem.transfer.selection import BackendSelector
from tandem.transfer.server import ControlServer
from tandem.transfer.shm import ShmProbe, ShmProofs
from tandem.transfer.wire import Done, Export, ExportReply

logger = logging.getLogger(__name__)
_RETAIN_S = 60.0  # finished ops stay queryable this long
P = ParamSpec("P")
R = TypeVar("R")


class TransferResult(NamedTuple):
    op_id: str
    backend: str
    num_bytes: int
    seconds: float


def _in_thread(method: Callable[P, R]) -> Callable[P, Coroutine[None, None, R]]:
    """``method`` as a coroutine function that runs it in a thread (`asyncio.to_thread`)."""

    @functools.wraps(method)
    async def run(*args: P.args, **kwargs: P.kwargs) -> R:
        return await asyncio.to_thread(method, *args, **kwargs)

    return run


class OpOptions(TypedDict, total=False):
    """Options of a new operation: its layers ``[a, b)`` (default all), ``ttl_s`` after which
    it is released unless claimed (default the config's), its ``op_id`` (default random) and
    ``on_release(op)``, run once when it ends (the owner unpins its blocks there)."""

    layers: tuple[int, int] | None
    ttl_s: float | None
    op_id: str | None
    on_release: ReleaseCallback | None


class TransferAgent:
    """Registers memory, creates operations, serves peers and runs transfers.

    Thread-safe. Blocking methods have `*_async` twins that run them in a thread
    (cancelling the awaiting task does not stop that thread; the timeout bounds it).
    `close` cancels live ops (their ``on_release`` runs), stops the server and unlinks
    the shared-memory segments this agent created.
    """

    def __init__(self, config: TransferAgentConfig | None = None) -> None:
        self.config = config or TransferAgentConfig()
        self.agent_id = (
            self.config.agent_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        )
        self.host_id = host_id()
        self.stats = TransferStats()
        sweep_stale_segments()
        self._probe = _shm_probe(self.agent_id)
        self.shm_probe = (self._probe.name, self._probe.digest) if self._probe else ("", b"")
        self._proofs = ShmProofs()
        self.pool = ConnectionPool(self.config.cluster_secret, self.config.tls)
        lazy = self.config.lazy_backends
        self._backends = self._create_backends(tuple(b for b in self.config.backends
                                                     if b not in lazy))  # fmt: skip
        self._lazy = installed_backends(
            tuple(b for b in self.config.backends if b in lazy), agent_id=self.agent_id
        )
        self._lazy_lock = threading.Lock()
        self._selector = BackendSelector(self._backends, self.agent_id)
        self._regions: dict[str, MemoryRegion] = {}
        self._handles: dict[str, dict[str, bytes]] = {}
        self._ops: dict[str, TransferOp] = {}
        self._timers: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self._closed = False
        # (op_id, block_hashes, ttl_s) -> blocks covered: opens the readable op a peer's KV
        # fetch asks for (`Export`); None: this agent exports nothing
        self.exporter: Callable[[str, list[int], float], int] | None = None
        self._server = ControlServer(self, self.config.host, self.config.port)
        self.address = (
            self.config.advertise_host or self._server.address[0],
            self._server.address[1],
        )
        self._reaper = threading.Thread(target=self._reap_loop, name="transfer-reaper", daemon=True)
        self._reaper.start()
        logger.info(
            "transfer agent=%s listening on %s:%d backends=%s%s",
            self.agent_id, *self.address, ",".join(self._backends),
            f" (started on the first peer on another host: {','.join(self._lazy)})"
            if self._lazy else "",
        )  # fmt: skip

    @property
    def backend_names(self) -> tuple[str, ...]:
        return tuple(self._backends)

    def _create_backends(self, names: tuple[str, ...]) -> dict[str, TransferBackend]:
        return create_backends(
            names,
            agent_id=self.agent_id,
            host=self.config.advertise_host or self.config.host,
        )

    def ensure_cross_host_backends(self, peer: str) -> None:
        """Start the lazy backends now that ``peer`` on another host may need them: register
        every region with them and prefer them in configured order. Idempotent; thread-safe;
        the first call pays the backends' start-up."""
        if not self._lazy:
            return
        with self._lazy_lock:
            names, self._lazy = self._lazy, ()
            if not names:
                return
            started = self._create_backends(names)
            with self._cond:
                regions = list(self._regions.values())
            for region in regions:
                handles = dict(self._handles.get(region.name, {}))
                for name, backend in started.items():
                    handle = backend.register(region)
                    if handle is not None:
                        handles[name] = handle
                self._handles[region.name] = handles
            merged = {**self._backends, **started}
            self._backends = {n: merged[n] for n in self.config.backends if n in merged}
            self._selector.update(self._backends)
        logger.info("transfer agent=%s: peer %s shares no memory with this one (another host "
                    "or container); started backends %s "
                    "(now %s)", self.agent_id, peer, ",".join(started) or "none",
                    ",".join(self._backends))  # fmt: skip

    def current_meta(self, op: TransferOp) -> TransferOpMeta:
        """``op``'s metadata with the backends and region handles as they are now (a lazy
        backend may have started since the op was created)."""
        handles = self._handles.get(op.meta.region, op.meta.handles)
        if handles is op.meta.handles and self.backend_names == op.meta.backends:
            return op.meta
        return msgspec.structs.replace(op.meta, backends=self.backend_names, handles=handles)

    # -- memory ---------------------------------------------------------------------------
    def create_region(self, name: str, layout: RegionLayout) -> MemoryRegion:
        """Allocate a zeroed region in shared memory (peers on this host can memcpy it)."""
        return self._add_region(create_shm_region(name, layout))

    def register_region(self, name: str, buffer: Any, layout: RegionLayout) -> MemoryRegion:
        """Register an existing numpy array / CPU tensor / mmap (no copy; keep it alive)."""
        region = MemoryRegion(name=name, layout=layout, data=as_bytes(buffer), _owner=buffer)
        return self._add_region(region)

    def _add_region(self, region: MemoryRegion) -> MemoryRegion:
        with self._cond:
            if region.name in self._regions:
                region.close()
                raise ValueError(f"region {region.name!r} is already registered")
            self._regions[region.name] = region
        handles = {}
        for name, backend in self._backends.items():
            handle = backend.register(region)
            if handle is not None:
                handles[name] = handle
        self._handles[region.name] = handles
        return region

    def unregister_region(self, name: str) -> None:
        with self._cond:
            region = self._regions.pop(name)
            self._handles.pop(name, None)
        for backend in self._backends.values():
            backend.unregister(region)
        region.close()

    def region(self, name: str) -> MemoryRegion:
        try:
            return self._regions[name]
        except KeyError:
            raise TransferError(
                f"no region {name!r}; registered: {sorted(self._regions)}"
            ) from None

    def backend(self, name: str) -> TransferBackend:
        try:
            return self._backends[name]
        except KeyError:
            raise TransferError(
                f"backend {name!r} is not enabled on agent {self.agent_id}"
            ) from None

    # -- operations (owner side) ----------------------------------------------------------
    def create_readable(
        self, region: str, block_ids: Sequence[int], **options: Unpack[OpOptions]
    ) -> TransferOp:
        """Export blocks for one peer to pull (see `OpOptions`)."""
        return self._create(OpKind.READABLE, region, block_ids, **options)

    def create_writable(
        self, region: str, block_ids: Sequence[int], **options: Unpack[OpOptions]
    ) -> TransferOp:
        """Offer blocks for one peer to push into (see `OpOptions`)."""
        return self._create(OpKind.WRITABLE, region, block_ids, **options)

    def _create(
        self,
        kind: OpKind,
        region_name: str,
        block_ids: Sequence[int],
        *,
        layers: tuple[int, int] | None = None,
        ttl_s: float | None = None,
        op_id: str | None = None,
        on_release: ReleaseCallback | None = None,
    ) -> TransferOp:
        region = self.region(region_name)
        lay = region.layout
        start, end = layers or (0, lay.num_layers)
        _check_blocks(block_ids, lay, start, end)
        ttl = self.config.default_ttl_s if ttl_s is None else ttl_s
        if ttl <= 0:
            raise ValueError(f"ttl_s={ttl} must be > 0")
        meta = TransferOpMeta(
            op_id=op_id or secrets.token_hex(8),
            kind=kind,
            agent_id=self.agent_id,
            host_id=self.host_id,
            address=self.address,
            backends=self.backend_names,
            region=region_name,
            layout=lay,
            block_ids=tuple(int(b) for b in block_ids),
            layer_start=start,
            layer_end=end,
            expires_at=time.time() + ttl,
            handles=self._handles[region_name],
        )
        op = TransferOp(meta, on_release=lambda o: self._released(o, on_release))
        with self._cond:
            if self._closed:
                raise TransferError(f"agent {self.agent_id} is closed")
            if meta.op_id in self._ops:
                raise ValueError(f"op_id {meta.op_id!r} already exists on agent {self.agent_id}")
            if len(self._ops) >= self.config.max_ops:
                raise TransferError(f"agent {self.agent_id} holds {len(self._ops)} ops (max_ops)")
            self._ops[meta.op_id] = op
            heapq.heappush(self._timers, (meta.expires_at, meta.op_id))
            self.stats.num_created += 1
            self._cond.notify_all()
        return op

    def find_op(self, op_id: str) -> TransferOp | None:
        with self._cond:
            return self._ops.get(op_id)

    def wait_for_op(self, op_id: str, timeout_s: float) -> TransferOp | None:
        """The op with ``op_id``, waiting up to ``timeout_s`` for it to be created."""
        with self._cond:
            self._cond.wait_for(lambda: op_id in self._ops or self._closed, timeout_s)
            return self._ops.get(op_id)

    def cancel(self, op_id: str, reason: str = "cancelled by owner") -> TransferOp | None:
        """Cancel a live op (its on_release runs); a finished op is left as it is."""
        op = self.find_op(op_id)
        if op is not None:
            op.finish(OpStatus.CANCELLED, reason)
        return op

    def wait(self, op_id: str, timeout_s: float) -> OpStatus:
        """Block until the op completes; TransferError if it failed, or on timeout."""
        op = self.find_op(op_id)
        if op is None:
            raise TransferError(f"transfer op={op_id}: unknown on agent {self.agent_id}")
        return op.wait(timeout_s)

    async def wait_async(self, op_id: str, timeout_s: float) -> OpStatus:
        return await asyncio.to_thread(self.wait, op_id, timeout_s)

    def finish_served(self, op: TransferOp, done: Done, moved: int) -> None:
        """The server's last step of a transfer into / out of one of our ops."""
        num_bytes = done.num_bytes or moved
        if not done.ok:
            op.finish(OpStatus.ERRORED, f"peer {op.peer} failed: {done.reason}")
        elif op.finish(OpStatus.COMPLETE, num_bytes=num_bytes, annex=done.annex):
            with self._cond:
                if op.meta.kind is OpKind.READABLE:
                    self.stats.bytes_sent += num_bytes
                else:
                    self.stats.bytes_received += num_bytes

    def _released(self, op: TransferOp, callback: ReleaseCallback | None) -> None:
        with self._cond:
            counter = f"num_{op.status.value}"
            setattr(self.stats, counter, getattr(self.stats, counter) + 1)
            op.retire_at = time.time() + _RETAIN_S
            heapq.heappush(self._timers, (op.retire_at, op.op_id))
            self._cond.notify_all()
        if callback is not None:
            callback(op)

    def _reap_loop(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.time()
                if not self._timers or self._timers[0][0] > now:
                    delay = self._timers[0][0] - now if self._timers else None
                    self._cond.wait(delay)
                    continue
                _, op_id = heapq.heappop(self._timers)
                op = self._ops.get(op_id)
                if op is not None and op.retire_at <= now:
                    del self._ops[op_id]  # finished and retained long enough
                    continue
            if op is not None and op.status is OpStatus.INITIALIZED:
                op.finish(
                    OpStatus.EXPIRED,
                    f"not claimed within its ttl (expired at {op.meta.expires_at:.3f})",
                )

    # -- transfers (initiator side) -------------------------------------------------------
    def pull(
        self,
        source: TransferOpMeta | OpRef,
        region: str,
        block_ids: Sequence[int],
        *,
        timeout_s: float | None = None,
    ) -> TransferResult:
        """Read a peer's readable op into our ``block_ids`` of ``region`` (same layers).

        Raises TransferError (op id, peer, reason) on any failure or after ``timeout_s``.
        """
        return self._transfer("pull", source, region, block_ids, timeout_s)

    def push(
        self,
        region: str,
        block_ids: Sequence[int],
        target: TransferOpMeta | OpRef,
        *,
        timeout_s: float | None = None,
        annex: bytes = b"",
    ) -> TransferResult:
        """Write our ``block_ids`` of ``region`` into a peer's writable op (same layers).
        ``annex`` (small, opaque) reaches the owner's `TransferOp.annex` with the completion,
        e.g. the prefill's first token for the decode to resume after."""
        return self._transfer("push", target, region, block_ids, timeout_s, annex)

    pull_async = _in_thread(pull)
    push_async = _in_thread(push)

    def _transfer(
        self,
        direction: str,
        target: TransferOpMeta | OpRef,
        region: str,
        block_ids: Sequence[int],
        timeout_s: float | None,
        annex: bytes = b"",
    ) -> TransferResult:
        timeout = self.config.io_timeout_s if timeout_s is None else timeout_s
        started = time.monotonic()
        backend, num_bytes = run_transfer(
            self, direction, target, self.region(region), [int(b) for b in block_ids], timeout,
            annex,
        )  # fmt: skip
        seconds = time.monotonic() - started
        with self._cond:
            if direction == "pull":
                self.stats.bytes_received += num_bytes
            else:
                self.stats.bytes_sent += num_bytes
            self.stats.num_transfers += 1
            self.stats.transfer_seconds += seconds
        return TransferResult(target.op_id, backend, num_bytes, seconds)

    def why_not_shared(self, probe: str, digest: bytes) -> str | None:
        return self._proofs.why_not_shared(probe, digest)

    def choose_backend(
        self, remote: TransferOpMeta, no_shared_memory: str | None
    ) -> TransferBackend:
        return self._selector.choose(remote, no_shared_memory)

    def cancel_remote(
        self, target: TransferOpMeta | OpRef, reason: str = "", timeout_s: float = 2.0
    ) -> str:
        """Cancel a peer's op (e.g. the request was aborted); returns its status after."""
        return send_control(
            self.agent_id,
            self.config.cluster_secret,
            target,
            "cancel",
            reason,
            timeout_s,
            self.config.tls,
            self.pool,
        )

    def cancel_remote_soon(self, target: TransferOpMeta | OpRef, reason: str) -> None:
        """`cancel_remote` in a thread, not waited for (best effort; see `cancel_soon`)."""
        cancel_soon(
            target,
            reason,
            sender_id=self.agent_id,
            cluster_secret=self.config.cluster_secret,
            tls=self.config.tls,
            pool=self.pool,
        )

    def query_remote(self, target: TransferOpMeta | OpRef, timeout_s: float = 2.0) -> str:
        return send_control(
            self.agent_id,
            self.config.cluster_secret,
            target,
            "query",
            "",
            timeout_s,
            self.config.tls,
            self.pool,
        )

    def serve_export(self, export: Export) -> ExportReply:
        """A connection thread: run the exporter for a peer's fetch; its failure is the
        reply's error (the peer recomputes), never this agent's."""
        exporter = self.exporter
        if exporter is None:
            return ExportReply(error=f"agent {self.agent_id} exports no KV (no --kv-fetch)")
        try:
            num_blocks = exporter(export.op_id, export.block_hashes, export.ttl_s)
        except Exception as exc:
            logger.debug("export op=%s for %s failed", export.op_id, export.peer, exc_info=True)
            return ExportReply(error=str(exc) or type(exc).__name__)
        return ExportReply(num_blocks=num_blocks)

    def request_export(
        self, target: OpRef, block_hashes: list[int], *, ttl_s: float, timeout_s: float
    ) -> int:
        """Ask a peer to open readable op ``target.op_id`` over the longest prefix of
        ``block_hashes`` it caches (then `pull` it); returns its blocks, 0 for none.
        TransferError when the peer is unreachable or refuses."""
        return send_export(
            self.agent_id, self.config.cluster_secret, target, block_hashes, ttl_s, timeout_s,
            self.config.tls, self.pool,
        )  # fmt: skip

    def families(self) -> list[Metric]:
        """This agent's counters as Prometheus families (``tandem_transfer_*``)."""
        return transfer_families(self.stats)

    # -- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            ops = list(self._ops.values())
            self._cond.notify_all()
        for op in ops:
            op.finish(OpStatus.CANCELLED, f"agent {self.agent_id} closed")
        self._server.close()
        self.pool.close()
        self._reaper.join(timeout=2.0)
        for name in list(self._regions):
            self.unregister_region(name)
        for backend in self._backends.values():
            backend.close()
        if self._probe is not None:
            self._probe.close()

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_blocks(block_ids: Sequence[int], lay: RegionLayout, start: int, end: int) -> None:
    if not 0 <= start < end <= lay.num_layers:
        raise ValueError(f"layers=({start}, {end}) outside [0, {lay.num_layers}]")
    if not block_ids:
        raise ValueError("block_ids is empty")
    bad = [b for b in block_ids if not 0 <= b < lay.num_blocks]
    if bad:
        raise ValueError(f"block_ids {bad[:8]} outside [0, {lay.num_blocks})")


def _shm_probe(agent_id: str) -> ShmProbe | None:
    """This agent's shared-memory probe; None (peers then use no shm with it) where /dev/shm
    cannot be written."""
    try:
        return ShmProbe()
    except OSError as exc:
        logger.info("transfer agent=%s: no shared-memory probe (%s); peers will not use shm "
                    "with it", agent_id, exc)  # fmt: skip
        return None


def host_id() -> str:
    """Hostname + kernel boot id, for logs: which machine a peer runs on. Whether two agents
    share /dev/shm is proven, not inferred from it (`shm.ShmProbe`)."""
    boot = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return f"{socket.gethostname()}/{boot}"
