"""Peer KV fetch (issue 31) between vLLM workers, through vLLM's NixlConnector in pull mode.

vLLM exports KV only as part of a request, so a fetch of the first L tokens (whole blocks)
of a prompt from holder A into worker B is three requests on the same prompt head,
``token_ids[:L + 1]`` (one token more, so A finds all L cached and computes one):

1. on A, the *export* (`export_request`, sent by the frontend: `tandem.disagg.vllm_fetch`):
   one token with ``do_remote_decode``; A keeps the blocks for its lease and returns vLLM's
   kv_transfer_params with the time by which a pull must start (`exported`);
2. on B, the *pull* (`VllmPeerFetch.pull`): the same prompt head with ``do_remote_prefill``
   and those params: vLLM pulls the blocks B lacks and commits them to B's prefix cache;
3. on B, the request itself, whose prefix lookup now finds the L tokens.

The same prompt head in 1 and 2 (vLLM asserts that the pulled blocks fit the prompt), the
same cache_salt and LoRA in all three. A pull is not started past half the lease (a read
of blocks A freed meanwhile fails silently), is aborted after ``timeout_s``, and whatever
fails (A gone: vLLM's handshake times out and the pull ends in error; a stale export; a
refusal) leaves step 3 to compute the prompt: the request never fails because of a fetch.
vLLM never commits a failed load. No vLLM import here: the frontend imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from tandem.engines.fetch_stats import PeerFetchStats
from tandem.engines.vllm.sampling import VLLM_PARAMS_KEY
from tandem.errors import InvalidRequest, TransferError
from tandem.protocols.engine import (
    EngineOutput,
    KvFetchHint,
    PreprocessedRequest,
    SamplingParams,
    StopConditions,
)

logger = logging.getLogger(__name__)

PROTOCOL = "vllm-nixl"  # KvFetchHint.protocol, FetchSource.protocol
EXPORT_KEY = "vllm_kv_export"  # disagg_params of a request asking its worker to export
START_BY_KEY = "start_by_s"  # wall-clock time (time.time()) by which the pull must start
EXPORT_S_KEY = "export_s"  # how long the export took, as the frontend measured it
DEFAULT_LEASE_S = 30  # vLLM's own kv_lease_duration default


def prefix_tokens(request: PreprocessedRequest, hint: KvFetchHint) -> int:
    """L: the prompt tokens whose KV moves, the hint's whole blocks but never the prompt's
    last token (the request computes at least that one)."""
    if hint.block_size <= 0:
        return 0
    max_blocks = (request.num_prompt_tokens - 1) // hint.block_size
    return min(len(hint.block_hashes), max_blocks) * hint.block_size


def _head(request: PreprocessedRequest, hint: KvFetchHint, suffix: str) -> PreprocessedRequest:
    """One greedy token on the prompt's first L + 1 tokens, with its salt, LoRA and class."""
    return msgspec.structs.replace(
        request,
        request_id=f"{request.request_id}-{suffix}",
        token_ids=request.token_ids[: prefix_tokens(request, hint) + 1],
        token_bytes=None,
        num_generated_tokens=0,
        sampling=SamplingParams(),
        stop=StopConditions(max_tokens=1),
        disagg_params=None,
        kv_fetch=None,
    )


def usable(request: PreprocessedRequest, hint: KvFetchHint) -> bool:
    """Whether the hint names a prefix the three steps can move: at least one block."""
    return hint.protocol == PROTOCOL and prefix_tokens(request, hint) > 0


def export_request(request: PreprocessedRequest, hint: KvFetchHint) -> PreprocessedRequest:
    """Step 1, for the holder's `generate` endpoint (check `usable` first)."""
    return msgspec.structs.replace(
        _head(request, hint, "kv-export"), disagg_params={EXPORT_KEY: True}
    )


def is_export(request: PreprocessedRequest) -> bool:
    return bool(request.disagg_params and request.disagg_params.get(EXPORT_KEY))


def exported(result: EngineOutput, lease_s: float) -> EngineOutput:
    """The holder's last output of an export: its kv_transfer_params (already in
    `disagg_params`) and the time by which a pull must start: half the lease from now."""
    if result.disagg_params is None or result.finish_reason == "error":
        return result
    params = {**result.disagg_params, START_BY_KEY: time.time() + lease_s / 2}
    return msgspec.structs.replace(result, disagg_params=params)


# step 2's runner: the engine's stream of a request with these SamplingParams.extra_args
PullRunner = Callable[[PreprocessedRequest, dict[str, Any]], AsyncIterator[EngineOutput]]


class VllmPeerFetch:
    """A vLLM worker's fetcher side (step 2) and its counters; one per `VllmEngine` with
    ``kv_fetch``. ``external_tokens`` reads vLLM's count of prompt tokens loaded from
    external KV so far (its stat logger's; updated before the request's output arrives)."""

    def __init__(
        self,
        *,
        block_size: int,
        bytes_per_token: int,
        timeout_s: float,
        lease_s: float,
        external_tokens: Callable[[], int],
    ) -> None:
        self.block_size, self.bytes_per_token = block_size, bytes_per_token
        self.timeout_s, self.lease_s = timeout_s, lease_s
        self.external_tokens = external_tokens
        # until measured: a memcpy-class figure; the router learns the real one from the load
        self.stats = PeerFetchStats(bandwidth_bytes_per_s=1e9)

    def metadata(self, *, address: tuple[str, int], agent_id: str) -> dict[str, Any]:
        """The instance metadata entry the router reads (tandem.router.fetch.FetchSource)."""
        return {
            "protocol": PROTOCOL,
            "address": list(address),  # vLLM's NIXL handshake listener (informational)
            "agent_id": agent_id,  # vLLM's engine id
            "bytes_per_token": self.bytes_per_token,
            "bandwidth_bytes_per_s": self.stats.bandwidth_bytes_per_s,
            "prefill_s_per_token": None,
        }

    async def pull(self, request: PreprocessedRequest, run: PullRunner) -> None:
        """Step 2 for ``request`` (its `kv_fetch` hint with the holder's export), through
        ``run``; returns when B's prefix cache holds the prefix or the fetch was given up
        (counted, logged). Raises only what ``run`` raises of the engine failing."""
        hint = request.kv_fetch
        if hint is None or not usable(request, hint):
            return
        self.stats.num_started += 1
        started = time.monotonic()
        export = hint.export or {}
        before = self.external_tokens()
        try:
            params = self._params(hint, export)
            step = _head(request, hint, "kv-fetch")
            async with asyncio.timeout(self.timeout_s):
                last = await last_output(run(step, {"kv_transfer_params": params}))
            if last is None or last.finish_reason not in ("stop", "length"):
                reason = last.error if last is not None else "no output"
                raise TransferError(f"vLLM's pull ended with {reason}")
        except (TransferError, InvalidRequest, TimeoutError) as exc:
            self.stats.num_fell_back += 1
            logger.info("request_id=%s: peer KV fetch from %s failed (%s); computing the "
                        "prompt here", request.request_id, hint.source_instance_id,
                        exc or type(exc).__name__)  # fmt: skip
            return
        pull_s = time.monotonic() - started
        moved = max(self.external_tokens() - before, 0)
        export_s = float(export.get(EXPORT_S_KEY, 0.0))
        self.stats.succeeded(
            num_blocks=moved // self.block_size, num_bytes=moved * self.bytes_per_token,
            seconds=export_s + pull_s, pull_s=pull_s,
        )  # fmt: skip

    def _params(self, hint: KvFetchHint, export: dict[str, Any]) -> dict[str, Any]:
        params = export.get(VLLM_PARAMS_KEY)
        if hint.block_size != self.block_size:
            raise TransferError(f"hint block_size {hint.block_size} != vLLM's {self.block_size}")
        if not isinstance(params, dict):
            raise TransferError(f"holder {hint.source_instance_id} exported nothing")
        late_s = time.time() - float(export.get(START_BY_KEY, 0.0))
        if late_s > 0:  # the holder may free the blocks while we read them: a silent misread
            raise TransferError(f"export {late_s:.3f} s past half of the holder's lease")
        params = {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}
        params["do_remote_prefill"], params["do_remote_decode"] = True, False
        return params


async def last_output(stream: AsyncIterator[EngineOutput]) -> EngineOutput | None:
    """The stream's final output (its last, if none finishes), the stream closed after it."""
    last = None
    async with contextlib.aclosing(stream):  # type: ignore[type-var]
        async for out in stream:
            last = out
            if out.finish_reason is not None:
                break
    return last
