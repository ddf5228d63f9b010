"""Continuous batching: waiting/running queues, chunked prefill, preemption by recompute.

Each step: drop aborted sequences, give every running sequence its next tokens (one for a
decode, a chunk of the rest for a prefill) within `max_num_batched_tokens`, preempting the
youngest running sequence when blocks run out, then admit waiting sequences while
`max_num_seqs`, the token budget and free blocks allow.

Priority (issue 33; `PreprocessedRequest.priority`, lower = more urgent): the waiting queue is
ordered by class (arrival order within one; a preempted sequence at the front of its class),
and the preemption victim is the youngest running sequence of the lowest class, never one
more urgent than the sequence that needs the blocks (that one yields instead). With one class
everywhere this is the plain FIFO / youngest-first policy. When classes or tenants mix
(`tandem.engines.step_policy`, shared with the mocker): the foreground's running sequences
and admissions come first, a waiting foreground sequence may have a background one preempted
for its seat, and the background prefills only what keeps the step within its bound (the
step's cost counted in tokens: no model of the CPU step's time here).

With speculation (`draft`), a decoding sequence also computes its draft tokens
(`Sequence.draft_token_ids`) when the budget and free blocks allow; a draft never preempts
anyone, never delays an admission and never evicts a cached prefix: drafts take only the
budget and the uncached free blocks the step left; without them the sequence decodes one
token.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tandem.engines import step_policy
from tandem.engines.native.block_manager import BlockManager
from tandem.engines.native.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledBatch:
    """Sequences of one step with the number of new tokens each computes; decodes
    (one token, or one and a draft) first, then prefill chunks. `aborted` were removed this
    step."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    aborted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class DraftFn(Protocol):
    def __call__(self, seq: Sequence, budget: int, *, seqs: int, rows: int) -> list[int]: ...


class Scheduler:
    """Not thread-safe; driven by the engine thread."""

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        background_step_slack: float = step_policy.BACKGROUND_STEP_SLACK,
        onboard: Callable[[Sequence, int], int] | None = None,
        draft: DraftFn | None = None,
    ) -> None:
        """`onboard(seq, num_cached_tokens)`, when given, runs at admission after the device
        prefix match and returns how many more prompt tokens it made cached (blocks brought
        back from a lower KV tier into the sequence's table). `draft(seq, budget, seqs=, rows=)`,
        when given, proposes at most `budget` speculative tokens for a decoding sequence in
        a step of `seqs` sequences and `rows` rows so far."""
        self.block_manager = block_manager
        self.onboard = onboard
        self.draft = draft
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.background_step_slack = background_step_slack  # engines/step_policy.py
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._aborts: set[str] = set()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue `seq` after every waiting sequence of its class or a more urgent one."""
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].priority > seq.priority:
            i -= 1
        self.waiting.insert(i, seq)

    def _requeue(self, seq: Sequence) -> None:
        """Put a preempted `seq` back before every waiting sequence of its class."""
        i = 0
        while i < len(self.waiting) and self.waiting[i].priority < seq.priority:
            i += 1
        self.waiting.insert(i, seq)

    @staticmethod
    def _victim(queue: list[Sequence], seq: Sequence) -> Sequence:
        """Whom to preempt so that `seq` gets blocks: the youngest of the least urgent class
        among `queue` (running, not yet given tokens this step), taken out of it; `seq`
        itself when that one is more urgent than `seq` or `queue` is empty."""
        if not queue:
            return seq
        i = max(range(len(queue)), key=lambda k: (queue[k].priority, k))
        if queue[i].priority < seq.priority:
            return seq
        return queue.pop(i)

    def abort(self, request_id: str) -> None:
        """Remove the request at the next `schedule()` (unknown ids are ignored)."""
        self._aborts.add(request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._drop_aborted(batch)
        budget = self.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        scheduled: list[tuple[Sequence, int]] = []
        held = self._shares()
        if held is None:
            budget = self._run(list(self.running), scheduled, budget)
            if self.waiting and self.num_preemptions == preemptions_before:
                budget = self._admit(scheduled, budget)
        else:
            budget = self._schedule_shared(scheduled, budget, held)
        if self.draft is not None:
            self._add_drafts(scheduled, budget)
        # decodes (drafts included) first, stable
        scheduled.sort(key=lambda item: item[1] != 1 and not item[0].draft_token_ids)
        batch.seqs = [s for s, _ in scheduled]
        batch.num_new_tokens = [n for _, n in scheduled]
        return batch

    def _run(
        self,
        queue: list[Sequence],
        scheduled: list[tuple[Sequence, int]],
        budget: int,
        allowance: step_policy.Allowance | None = None,
        num: int | None = None,
    ) -> int:
        """Give the first `num` (default: all) running sequences of `queue` their tokens in
        order, taking them out of it (with an `allowance`, no more decodes and prefill
        tokens than it allows; one left out keeps its seat and blocks; a victim for blocks
        is any of `queue`); returns the budget left."""
        left = None if allowance is None else step_policy.AllowanceLeft(allowance)
        while queue and budget > 0 and (num is None or num > 0):
            seq = queue.pop(0)
            num = None if num is None else num - 1
            num_new = min(seq.num_uncomputed_tokens, budget)
            if left is not None:
                num_new = left.take(seq.num_uncomputed_tokens, num_new)
                if num_new == 0:
                    continue
            seq.draft_token_ids = []
            while not self.block_manager.ensure_slots(seq, seq.num_computed_tokens + num_new):
                victim = self._victim(queue, seq)
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled.append((seq, num_new))
                budget -= num_new
        return budget

    def _shares(self) -> step_policy.Shares | None:
        """The seat shares when classes or tenants mix here; None when they do not."""
        seqs = [*self.running, *self.waiting]
        if all(s.priority == seqs[0].priority and s.tenant == seqs[0].tenant for s in seqs):
            return None
        return step_policy.shares(self.running, self.waiting, self.max_num_seqs)

    def _schedule_shared(
        self, scheduled: list[tuple[Sequence, int]], budget: int, held: step_policy.Shares
    ) -> int:
        """Classes or tenants mix: the foreground first (running, then admitted, preempting
        background seats for it), then the background within the step's bound."""
        self.running.sort(key=held.is_background)  # stable; the foreground is one class
        num_fg = sum(1 for s in self.running if not held.is_background(s))
        queue = list(self.running)
        before = self.num_preemptions
        budget = self._run(queue, scheduled, budget, num=num_fg)
        if self.num_preemptions != before or budget <= 0:
            return budget
        if self.waiting:
            budget = self._admit(scheduled, budget, held=held)
        rest = [s for s in queue if s.status is SequenceStatus.RUNNING]
        bg_decodes = sum(1 for s in rest if s.num_uncomputed_tokens == 1)
        num_prefill = sum(n for s, n in scheduled if s.num_uncomputed_tokens > 1)
        fg_decodes = sum(1 for s, _ in scheduled if s.num_uncomputed_tokens == 1)
        allowance = step_policy.Allowance(bg_decodes, budget)
        if scheduled:  # the step's cost in tokens
            allowance = step_policy.background_allowance(
                lambda n, d: n + d, num_prefill, fg_decodes, bg_decodes, budget,
                self.background_step_slack,
            )  # fmt: skip
        before = self.num_preemptions
        budget = self._run(rest, scheduled, budget, allowance=allowance)
        cap = min(budget, allowance.num_prefill_tokens)
        if self.waiting and cap > 0 and self.num_preemptions == before:
            budget -= cap - self._admit(scheduled, cap)
        return budget

    def _admit(
        self,
        scheduled: list[tuple[Sequence, int]],
        budget: int,
        *,
        held: step_policy.Shares | None = None,
    ) -> int:
        """Admit waiting sequences in queue order while seats, budget and blocks allow. With
        `held`, only the foreground: the first of the most urgent class waiting whose tenant
        has room, preempting a running background sequence it outranks when the seats are
        full. Returns the budget left."""
        bm = self.block_manager
        while self.waiting and budget > 0:
            i = 0 if held is None else step_policy.next_foreground(self.waiting, held)
            if i is None:
                break
            seq = self.waiting[i]
            seats_full = len(self.running) >= self.max_num_seqs
            if seats_full and not step_policy.free_a_seat(
                seq, self.running, scheduled, held, self._preempt
            ):
                break
            cached = bm.match_prefix(seq)
            if self.onboard is not None:
                cached += self.onboard(seq, cached)
            num_new = min(len(seq.token_ids) - cached, budget)
            if not bm.ensure_slots(seq, cached + num_new):
                bm.free(seq)
                break
            self.waiting.remove(seq)
            if held is not None:
                held.move(seq, 1)
            seq.num_computed_tokens = cached
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = cached
            seq.status = SequenceStatus.RUNNING
            i = len(self.running)  # by class, admission order within one: the urgent first
            while i > 0 and self.running[i - 1].priority > seq.priority:
                i -= 1
            self.running.insert(i, seq)
            scheduled.append((seq, num_new))
            budget -= num_new
        return budget

    def _add_drafts(self, scheduled: list[tuple[Sequence, int]], budget: int) -> None:
        """Give decoding sequences their drafts from what the step left: budget and free
        blocks after every running and admitted sequence has its tokens."""
        assert self.draft is not None
        rows = sum(n for _, n in scheduled)
        for i, (seq, num_new) in enumerate(scheduled):
            if budget <= 0:
                return
            if num_new != 1 or seq.num_uncomputed_tokens != 1:
                continue
            draft = self.draft(seq, budget, seqs=len(scheduled), rows=rows)
            if draft and self.block_manager.ensure_slots(
                seq, seq.num_computed_tokens + 1 + len(draft), evict=False
            ):
                seq.draft_token_ids = draft
                scheduled[i] = (seq, 1 + len(draft))
                budget -= len(draft)
                rows += len(draft)

    def _preempt(self, seq: Sequence) -> None:
        logger.debug("preempting request_id=%s", seq.request_id)
        self.block_manager.free(seq)
        seq.draft_token_ids = []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if seq in self.running:
            self.running.remove(seq)
        self._requeue(seq)

    def _drop_aborted(self, batch: ScheduledBatch) -> None:
        if not self._aborts:
            return
        for seqs in (self.running, self.waiting):
            for seq in [s for s in seqs if s.request_id in self._aborts]:
                seqs.remove(seq)
                self.finish(seq, "cancelled")
                batch.aborted.append(seq)
        self._aborts.clear()

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and free its blocks (the caller already removed it from queues)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)

    def drop(self, seq: Sequence, reason: str) -> None:
        """Take `seq` out of whichever queue holds it and free its blocks (its step failed)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.finish(seq, reason)

    def update(self, batch: ScheduledBatch) -> None:
        """After the forward and the new tokens' append: advance progress and announce newly
        full blocks. A drafting sequence's `num_new_tokens` must by now count only the
        positions whose tokens were kept (its last token and the accepted draft); the blocks
        it took for the rejected rest are given back."""
        bm = self.block_manager
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += num_new
            bm.commit(seq)
            if seq.draft_token_ids:
                seq.draft_token_ids = []
                bm.trim(seq, len(seq.token_ids))

    def retire(self, finished: list[Sequence]) -> None:
        """Remove sequences that finished this step from the running queue."""
        for seq in finished:
            self.running.remove(seq)
            seq.status = SequenceStatus.FINISHED
            self.block_manager.free(seq)
