"""vLLM-style continuous batching over a `BlockPool`, one synchronous `step()` at a time.

Each step: running sequences first (in admission order; a sequence mid-prefill gets its next
chunk, a decoding one its last token), preempting the most recently admitted of the least
urgent priority class (LIFO within it, recompute: its blocks are released and it rejoins the
head of its class in the waiting queue, which is ordered by class) when blocks run out;
then, if nothing was preempted, waiting sequences join while `max_num_seqs`, the token budget
(`max_num_batched_tokens`) and free blocks allow, starting after their cached prefix. A
sequence whose tokens are all computed samples one new token. When classes or tenants mix
(`tandem.engines.step_policy`, shared with the native engine): the foreground's running
sequences and admissions come first, a waiting foreground sequence may have a background one
preempted for its seat, and the background gets the decodes and prefill that keep the step
within its bound by the perf model. Requests join (`add_request`)
and leave (`abort`, finishing) between steps. Simulated time advances by the perf model
(`clock_ms`). Deterministic; not thread-safe.

With `config.kvbm`, a `SimBlockManager` stands behind the pool: blocks evicted in a step are
offloaded (accounted) at its end, and admission onboards the prompt's next blocks found in
the simulated host/disk tiers after the device match, as cached tokens; their simulated copy
time is added to the step. Tier KV events (medium host/disk) join the step's events.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tandem.engines import step_policy
from tandem.engines.mocker import perf_model
from tandem.engines.mocker.admission import make_sequence
from tandem.engines.mocker.c_block_pool import new_block_pool
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.sequence import Sequence
from tandem.errors import InvalidRequest, TransferError
from tandem.kvbm.args import with_block_bytes
from tandem.kvbm.base import BlockMeta
from tandem.kvbm.sim import SimBlockManager
from tandem.protocols.engine import EngineOutput, FinishReason, PreprocessedRequest
from tandem.protocols.kv_events import KvEvent


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """What one pass did: one output per sequence that produced a token, the KV events it
    caused and its simulated duration."""

    outputs: list[tuple[Sequence, EngineOutput]]
    events: list[KvEvent]
    duration_ms: float
    num_prefill_tokens: int
    num_decode_seqs: int
    num_decode_kv_tokens: int = 0  # context tokens the decoding sequences attended over


class Scheduler:
    def __init__(self, config: MockerConfig) -> None:
        self.config = config
        self.pool = new_block_pool(
            config.num_blocks, config.block_size, keep_token_ids=config.kv_events_token_ids
        )
        self.perf = perf_model.make_perf_model(config.perf_profile)
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._requests: dict[str, Sequence] = {}
        self.clock_ms = 0.0
        self.num_preemptions = 0
        self._ended: list[tuple[Sequence, EngineOutput]] = []  # finished outside sampling
        # disaggregation (tandem.engines.mocker.disagg): prompt blocks of finished prefills
        # kept for a decode to claim, and decode-side blocks waiting for their KV
        self.pin_on_finish: set[str] = set()
        self.pins: dict[str, list[int]] = {}
        self.held: dict[str, Sequence] = {}
        self._tier_events: list[KvEvent] = []
        self._onboard_ms = 0.0  # simulated copy time of this step's onboards
        self.kvbm: SimBlockManager | None = None
        if config.kvbm is not None:
            block_bytes = config.kv_bytes_per_token * config.block_size
            self.kvbm = SimBlockManager(
                with_block_bytes(config.kvbm, block_bytes),
                on_events=self._tier_events.extend,
                clock=lambda: self.clock_ms / 1000.0,
            )
            self.pool.record_evictions = True

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def add_request(self, request: PreprocessedRequest) -> Sequence:
        """Queue `request`. Raises InvalidRequest / ContextLengthExceeded if it can never run."""
        seq = make_sequence(self.config, request, self._requests)
        self._requests[seq.request_id] = seq
        i = len(self._waiting)  # after every waiting request of its class or a more urgent one
        while i > 0 and self._waiting[i - 1].priority > seq.priority:
            i -= 1
        self._waiting.insert(i, seq)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        """Remove the request now and free its blocks; None if unknown or already finished."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return None
        if seq.block_ids:
            self._running.remove(seq)
            self._free(seq)
        else:
            self._waiting.remove(seq)
        seq.finish_reason = "cancelled"
        return seq

    # ------------------------------------------------------------------ one pass
    def step(self) -> StepResult:
        scheduled: list[tuple[Sequence, int]] = []
        budget = self.config.max_num_batched_tokens
        held = self._shares()
        if held is not None:
            self._schedule_shared(scheduled, budget, held)
        else:
            _, budget, preempted = self._schedule_running(scheduled, budget, 0)
            if not preempted:
                self._admit_waiting(scheduled, budget)
        outputs, self._ended = self._ended, []
        finished: list[Sequence] = []
        num_prefill_tokens = num_decode = num_decode_kv = prefilling_blocks = 0
        size = self.config.block_size
        for seq, num_new in scheduled:  # once per running sequence per step: kept lean
            num_tokens = len(seq.token_ids)
            is_decode = (
                num_new == 1
                and num_tokens > seq.num_prompt_tokens  # has output tokens
                and seq.num_computed_tokens == num_tokens - 1
            )
            if is_decode:
                num_decode += 1
                num_decode_kv += num_tokens
            else:
                num_prefill_tokens += num_new
                # the blocks it took beyond its cache hits are its own: no decode reads them
                prefilling_blocks += len(seq.block_ids) - (seq.num_cached_tokens or 0) // size
            seq.num_computed_tokens += num_new
            if seq.num_computed_tokens // size > seq.num_committed_blocks:
                self._commit_full_blocks(seq)
            if seq.num_computed_tokens == num_tokens:
                outputs.append(self._sample(seq, finished))
        # the decode pass reads the KV in use but for what prefilling sequences hold themselves
        # (a 61k prompt mid-chunk does not slow the decodes beside it; Dynamo's mocker agrees)
        pool = self.pool
        usage = max(pool.num_active_blocks - prefilling_blocks, 0) / pool.num_blocks
        duration = self.perf.step_ms(num_prefill_tokens, num_decode, num_decode_kv, usage)
        duration += self._onboard_ms
        self._onboard_ms = 0.0
        self.clock_ms += duration
        self._offload_evicted()
        for seq in finished:
            if seq.request_id in self.pin_on_finish:
                self._pin(seq)
            self._finish(seq, seq.finish_reason)
        if finished:
            self._running = [s for s in self._running if s.finish_reason is None]
        events = self.pool.drain_events()
        if self._tier_events:
            events += self._tier_events
            self._tier_events.clear()  # the sink holds this list: clear, never rebind
        return StepResult(
            outputs=outputs,
            events=events,
            duration_ms=duration,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_seqs=num_decode,
            num_decode_kv_tokens=num_decode_kv,
        )

    def _schedule_running(
        self,
        scheduled: list[tuple[Sequence, int]],
        budget: int,
        idx: int,
        *,
        stop: int | None = None,
        allowance: step_policy.Allowance | None = None,
    ) -> tuple[int, int, bool]:
        """Give running sequences from position `idx` (up to `stop`) their tokens; with an
        `allowance`, no more decodes and prefill tokens than it allows (a sequence left out
        keeps its seat and blocks). Returns where it stopped, the budget left and whether it
        preempted (which ends the step's scheduling)."""
        left = None if allowance is None else step_policy.AllowanceLeft(allowance)
        preempted = False
        while idx < len(self._running) and (stop is None or idx < stop) and budget > 0:
            seq = self._running[idx]
            num_left = len(seq.token_ids) - seq.num_computed_tokens
            num_new = min(num_left, budget)
            if left is not None:
                num_new = left.take(num_left, num_new)
                if num_new == 0:
                    idx += 1
                    continue
            while not self._grow(seq, num_new):
                victim = self._victim(idx, seq)
                preempted = True
                if victim is not seq:
                    self._preempt(victim)
                    stop = None if stop is None else min(stop, len(self._running))
                    continue
                if len(self._running) == 1:  # alone and still too big for the whole pool
                    self._running.pop()
                    self._finish(seq, "length")
                    self._ended.append((seq, EngineOutput(finish_reason="length")))
                else:
                    self._preempt(seq)
                return idx, budget, True
            scheduled.append((seq, num_new))
            budget -= num_new
            idx += 1
        return idx, budget, preempted

    def _shares(self) -> step_policy.Shares | None:
        """The seat shares when classes or tenants mix on this engine; None when they do not
        (then nobody is outranked and the step is the plain one)."""
        live = iter(self._requests.values())
        first = next(live, None)
        if first is None:
            return None
        klass, tenant = first.priority, first.tenant
        if all(s.priority == klass and s.tenant == tenant for s in live):
            return None
        return step_policy.shares(self._running, self._waiting, self.config.max_num_seqs)

    def _schedule_shared(
        self, scheduled: list[tuple[Sequence, int]], budget: int, held: step_policy.Shares
    ) -> None:
        """Classes or tenants mix (engines/step_policy.py): the foreground's running sequences
        and admissions first (a waiting foreground sequence may have a background one
        preempted for its seat), then the background's decodes and the prefill that keeps
        the step within its bound."""
        self._running.sort(key=held.is_background)  # stable; the foreground is one class
        num_fg = sum(1 for s in self._running if not held.is_background(s))
        idx, budget, preempted = self._schedule_running(scheduled, budget, 0, stop=num_fg)
        if preempted or idx < num_fg:
            return
        budget = self._admit_waiting(scheduled, budget, held=held)
        done = {id(s) for s, _ in scheduled}
        self._running.sort(key=lambda s: id(s) not in done)  # class order kept: see above
        fg_decodes = bg_decodes = num_decode_kv = num_prefill = 0
        for seq in self._running:
            if len(seq.token_ids) - seq.num_computed_tokens == 1:
                num_decode_kv += len(seq.token_ids)
                bg_decodes += 1
        for seq, num_new in scheduled:
            if num_new > 1 or len(seq.token_ids) - seq.num_computed_tokens > 1:
                num_prefill += num_new
            else:
                fg_decodes += 1
        if not scheduled:  # no foreground work in this step: the background has it all
            allowance = step_policy.Allowance(bg_decodes, budget)
        else:
            usage, bg_decodes = self.pool.usage, bg_decodes - fg_decodes
            kv_per_decode = num_decode_kv / max(fg_decodes + bg_decodes, 1)

            def cost(num_tokens: int, num_decodes: int) -> float:
                kv = round(kv_per_decode * num_decodes)
                return self.perf.step_ms(num_tokens, num_decodes, kv, usage)

            allowance = step_policy.background_allowance(
                cost, num_prefill, fg_decodes, bg_decodes, budget,
                self.config.background_step_slack,
            )  # fmt: skip
        idx, budget, preempted = self._schedule_running(
            scheduled, budget, len(scheduled), allowance=allowance
        )
        if not preempted and allowance.num_prefill_tokens > 0:
            self._admit_waiting(scheduled, min(budget, allowance.num_prefill_tokens))

    def _join_running(self, seq: Sequence) -> None:
        """Running sequences are kept by class (admission order within one): each step gives
        the more urgent ones their tokens first, and the youngest of the least urgent class
        is last (issue 33)."""
        i = len(self._running)
        while i > 0 and self._running[i - 1].priority > seq.priority:
            i -= 1
        self._running.insert(i, seq)

    def _victim(self, idx: int, seq: Sequence) -> Sequence:
        """The youngest running sequence of the least urgent class after position `idx`
        (not yet given tokens this step); `seq` itself when that one is more urgent than it
        (issue 33; with one class: the youngest, LIFO)."""
        rest = range(idx + 1, len(self._running))
        if not rest:
            return seq
        i = max(rest, key=lambda k: (self._running[k].priority, k))
        victim = self._running[i]
        return seq if victim.priority < seq.priority else victim

    def _admit_waiting(
        self,
        scheduled: list[tuple[Sequence, int]],
        budget: int,
        *,
        held: step_policy.Shares | None = None,
    ) -> int:
        """Admit waiting sequences in queue order while seats, budget and blocks allow.
        With `held`, only the foreground (nobody outranks it), the first of the most urgent
        class whose tenant has room, which may have a running background sequence it
        outranks preempted for a seat. Returns the budget left."""
        size = self.config.block_size
        while self._waiting and budget > 0:
            i = 0 if held is None else step_policy.next_foreground(self._waiting, held)
            if i is None:
                return budget
            seq = self._waiting[i]
            if len(self._running) >= self.config.max_num_seqs:
                if not step_policy.free_a_seat(seq, self._running, scheduled, held, self._preempt):
                    return budget
                i = self._waiting.index(seq)  # the victim may have been requeued ahead of it
            # at least one token is always computed, so the last block is never a hit
            hashes = seq.hashes_upto((len(seq.token_ids) - 1) // size)
            hits = self.pool.match_prefix(hashes)
            self.pool.acquire(hits)
            hits += self._onboard(seq, hashes, len(hits))
            num_cached = len(hits) * size
            num_new = min(len(seq.token_ids) - num_cached, budget)
            fresh = self.pool.allocate(-(-(num_cached + num_new) // size) - len(hits))
            if fresh is None:
                self.pool.release(hits)
                return budget
            seq.block_ids = hits + fresh
            seq.num_computed_tokens = num_cached
            seq.num_committed_blocks = len(hits)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = num_cached
            del self._waiting[i]
            self._join_running(seq)
            if held is not None:
                held.move(seq, 1)
            scheduled.append((seq, num_new))
            budget -= num_new
        return budget

    # ------------------------------------------------------------------ helpers
    def _onboard(self, seq: Sequence, hashes: list[int], num_hits: int) -> list[int]:
        """Fresh blocks, cached, holding the prompt blocks after the device hits that the
        simulated tiers had (as many as the pool can give); [] without tiers."""
        if self.kvbm is None:
            return []
        candidates: list[int] = []
        for h in hashes[num_hits:]:
            if self.pool.match_prefix([h]):
                break
            candidates.append(h)
        limit = min(len(candidates), self.pool.num_allocatable_blocks)
        found = self.kvbm.onboard(
            candidates[:limit], num_device_hits=num_hits, num_lookup_blocks=len(hashes)
        )
        if not found.num_blocks:
            return []
        fresh = self.pool.allocate(found.num_blocks)
        assert fresh is not None, "fewer allocatable blocks than counted"
        size = self.config.block_size
        end = num_hits + found.num_blocks
        self.pool.cache_full_blocks(
            fresh,
            hashes[num_hits:end],
            hashes[num_hits - 1] if num_hits else None,
            seq.token_ids[num_hits * size : end * size],
            seq.lora_name,
        )
        self._onboard_ms += found.seconds * 1000.0
        return fresh

    def _offload_evicted(self) -> None:
        if self.kvbm is None:
            return
        self.kvbm.tick()
        size = self.config.block_size
        for e in self.pool.take_evicted():
            meta = BlockMeta(
                block_size=size,
                token_ids=e.token_ids,
                parent_hash=e.parent_hash,
                lora_name=e.lora_name,
            )
            self.kvbm.offload(e.block_hash, meta)

    def _grow(self, seq: Sequence, num_new: int) -> bool:
        """Give `seq` the blocks to hold `num_new` more tokens; False if the pool is short."""
        size = self.config.block_size
        need = -(-(seq.num_computed_tokens + num_new) // size) - len(seq.block_ids)
        if need <= 0:
            return True
        fresh = self.pool.allocate(need)
        if fresh is None:
            return False
        seq.block_ids.extend(fresh)
        return True

    def _commit_full_blocks(self, seq: Sequence) -> None:
        start, end = seq.num_committed_blocks, seq.num_computed_tokens // self.config.block_size
        if end <= start:
            return
        size = self.config.block_size
        hashes = seq.hashes_upto(end)
        self.pool.cache_full_blocks(
            seq.block_ids[start:end],
            hashes[start:end],
            hashes[start - 1] if start else None,
            seq.token_ids[start * size : end * size],
            seq.lora_name,
        )
        seq.num_committed_blocks = end

    def _sample(self, seq: Sequence, finished: list[Sequence]) -> tuple[Sequence, EngineOutput]:
        token, reason = seq.append_next_token(self.config.first_token_id, self.config.vocab_size)
        out = EngineOutput(token_ids=[token], finish_reason=reason)
        if not seq.is_cached_reported:
            seq.is_cached_reported = True
            out.num_cached_tokens = seq.num_cached_tokens
        if reason is not None:
            seq.finish_reason = reason
            finished.append(seq)
        return seq, out

    def _preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: drop the KV, requeue at the head of its class."""
        self._running.remove(seq)
        self._free(seq)
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        i = 0  # before every waiting request of its class
        while i < len(self._waiting) and self._waiting[i].priority < seq.priority:
            i += 1
        self._waiting.insert(i, seq)

    def _free(self, seq: Sequence) -> None:
        self.pool.release(seq.block_ids)
        seq.block_ids = []

    def _finish(self, seq: Sequence, reason: FinishReason | None) -> None:
        self._free(seq)
        self._requests.pop(seq.request_id, None)
        seq.finish_reason = reason

    # ------------------------------------------------------------------ disaggregation
    def _pin(self, seq: Sequence) -> None:
        self.pin_on_finish.discard(seq.request_id)
        blocks = seq.block_ids[: -(-seq.num_prompt_tokens // self.config.block_size)]
        self.pool.acquire(blocks)  # in use by seq: just one more reference each
        self.pins[seq.request_id] = list(blocks)

    def unpin(self, request_id: str) -> None:
        """Drop a finished prefill's pins (idempotent)."""
        blocks = self.pins.pop(request_id, None)
        if blocks is not None:
            self.pool.release(blocks)

    def hold(self, seq: Sequence, num_tokens: int, num_cached: int = 0) -> list[int] | None:
        """Give ``seq`` (not queued) blocks for ``num_tokens`` tokens: its first
        ``num_cached`` prompt blocks from the prefix cache (shared; `TransferError` if it no
        longer holds them all), fresh ones after; None if the pool is short."""
        hits: list[int] = []
        if num_cached > 0:
            hits = self.pool.match_prefix(seq.hashes_upto(num_cached))
            if len(hits) < num_cached:
                raise TransferError(
                    f"request_id={seq.request_id}: {len(hits)} of the prompt's first "
                    f"{num_cached} blocks are still cached here"
                )
            self.pool.acquire(hits)
        fresh = self.pool.allocate(-(-num_tokens // self.config.block_size) - len(hits))
        if fresh is None:
            self.pool.release(hits)
            return None
        seq.block_ids = hits + fresh
        seq.num_committed_blocks = len(hits)
        self.held[seq.request_id] = seq
        return list(seq.block_ids)

    def release_held(self, request_id: str) -> None:
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self._free(seq)

    def resume(self, request_id: str, num_computed: int) -> Sequence:
        """Run a held sequence whose first ``num_computed`` tokens are computed."""
        if request_id in self._requests:
            self.release_held(request_id)
            raise InvalidRequest(f"request_id={request_id!r} is already in flight")
        seq = self.held.pop(request_id)
        seq.num_computed_tokens = num_computed
        seq.num_cached_tokens = 0
        self._requests[request_id] = seq
        self._running.append(seq)
        return seq

    def check_integrity(self) -> None:
        """The pool's own checks, plus: every reference is held by exactly one live
        sequence's block list, waiting sequences hold no blocks, limits are respected."""
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for seq in self._running:
            assert seq.finish_reason is None, f"finished {seq.request_id} still running"
            for block_id in seq.block_ids:
                refs[block_id] = refs.get(block_id, 0) + 1
        for seq in self._waiting:
            assert not seq.block_ids, f"waiting {seq.request_id} holds blocks"
        for blocks in [*self.pins.values(), *(s.block_ids for s in self.held.values())]:
            for block_id in blocks:
                refs[block_id] = refs.get(block_id, 0) + 1
        for block_id in range(self.pool.num_blocks):
            if self.pool.ref_count(block_id) != refs.get(block_id, 0):
                raise AssertionError(
                    f"block {block_id}: ref_count {self.pool.ref_count(block_id)}, "
                    f"held by {refs.get(block_id, 0)} sequences"
                )
        assert len(self._running) <= self.config.max_num_seqs
        assert len(self._requests) == len(self._running) + len(self._waiting)
