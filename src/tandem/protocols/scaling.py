"""What the planner reads (DESIGN.md §11), as published on tandem's event plane.

Version 1, msgspec msgpack; unknown fields are ignored on decode.
Subjects:
- `{namespace}.{component}.worker_stats`: one `WorkerStats` per worker per publish period:
  its lifecycle state and the engine steps it ran since the last message.
- `{namespace}.frontend.request_stats`: one `RequestStats` per (model, pool) per interval
  from each frontend.
"""

from __future__ import annotations

from typing import Literal

import msgspec

WorkerState = Literal["starting", "ready", "draining", "stopped"]


class StepSample(msgspec.Struct, array_like=True):
    """One engine step: its wall time and what it computed."""

    wall_ms: float
    num_prefill_tokens: int  # uncached prompt tokens computed in this step
    num_decode_kv_tokens: int  # context tokens read by this step's decoding sequences
    num_running: int
    num_waiting: int


class WorkerStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    version: int = 1
    worker_id: str
    component: str
    state: WorkerState
    timestamp_s: float
    num_inflight: int = 0  # requests the worker is serving (what a drain waits for)
    num_active_blocks: int = 0
    num_total_blocks: int = 0
    num_cached_blocks: int = 0  # prefix-cache value a victim choice weighs
    steps: list[StepSample] = msgspec.field(default_factory=list)


class RequestStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One frontend's requests of one model and pool over `[start_s, end_s)`.
    Latency sums let a reader merge several frontends' intervals exactly (sum / count)."""

    version: int = 1
    frontend_id: str
    model: str
    pool: str  # worker component the frontend routes to
    start_s: float
    end_s: float
    num_arrivals: int = 0
    num_finished: int = 0
    num_failed: int = 0
    sum_isl: float = 0.0  # over finished requests
    sum_osl: float = 0.0
    sum_cached_tokens: float = 0.0
    num_ttft: int = 0
    sum_ttft_ms: float = 0.0
    max_ttft_ms: float = 0.0
    num_itl: int = 0  # inter-token gaps
    sum_itl_ms: float = 0.0
    # each dispatch: time from asking the router to its decision (its queue, when every
    # worker is over a busy threshold, and the choice itself)
    num_dispatched: int = 0
    sum_queue_wait_ms: float = 0.0
    max_queue_wait_ms: float = 0.0


_encoder = msgspec.msgpack.Encoder()
_worker_stats = msgspec.msgpack.Decoder(WorkerStats)
_request_stats = msgspec.msgpack.Decoder(RequestStats)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_worker_stats(data: bytes) -> WorkerStats:
    return _worker_stats.decode(data)


def decode_request_stats(data: bytes) -> RequestStats:
    return _request_stats.decode(data)


def worker_stats_subject(namespace: str, component: str) -> str:
    return f"{namespace}.{component}.worker_stats"


def request_stats_subject(namespace: str) -> str:
    return f"{namespace}.frontend.request_stats"
