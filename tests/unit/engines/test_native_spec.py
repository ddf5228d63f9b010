"""Prompt-lookup speculative decoding in the native engine (engines/native/speculation.py):
the n-gram drafter, the acceptance rules, and the engine with drafts (a tiny model with
scripted drafts for exact control; SmolLM2's real output in test_native_spec_smollm2.py)."""

from __future__ import annotations

import argparse
import copy
from collections import Counter

import pytest
import torch
from native_tiny import request, tiny_core

from tandem.engines.native.args import add_args, config_from_args
from tandem.engines.native.config import NativeConfig
from tandem.engines.native.draft_odds import DraftOdds, expected_tokens
from tandem.engines.native.engine import NativeEngine
from tandem.engines.native.engine_core import EngineCore
from tandem.engines.native.sequence import Sequence
from tandem.engines.native.speculation import (
    MAX_BACKOFF_STEPS,
    NgramProposer,
    StepCost,
    accept_greedy,
    accept_sampled,
    best_length,
)
from tandem.engines.worker_metrics import text_families
from tandem.protocols.engine import PreprocessedRequest
from tandem.protocols.kv_events import BlockStored

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------- the drafter
def test_proposer_takes_the_longest_recurring_suffix_then_the_most_recent():
    p = NgramProposer(3, 1, 3)
    # suffix [1, 2, 3]: matched in full at 0 (followed by 7 8 9); [2, 3] alone later (by 5)
    assert p.propose([1, 2, 3, 7, 8, 9, 2, 3, 5, 1, 2, 3]) == [7, 8, 9]
    # two equally long matches: the most recent one drafts
    assert p.propose([4, 5, 6, 4, 5, 7, 4, 5]) == [7, 4, 5]
    # fewer than k tokens follow the match: what there is
    assert p.propose([4, 5, 6, 4, 5]) == [6, 4, 5]
    assert p.propose([1, 2, 9, 1, 2]) == [9, 1, 2]
    assert p.propose([1, 2, 3, 4], max_tokens=2) == []  # nothing recurs
    assert p.propose([1, 2, 1, 2], max_tokens=1) == [1]
    assert p.propose([1, 2, 1, 2], max_tokens=0) == []


def test_proposer_needs_ngram_min_tokens_of_match():
    p = NgramProposer(4, 2, 4)
    assert p.propose([1, 9, 8, 3, 1]) == []  # only [1] recurs
    assert p.propose([3, 1, 9, 8, 3, 1]) == [9, 8, 3, 1]
    assert NgramProposer(4, 3, 4).propose([3, 1, 9, 8, 3, 1]) == []
    assert p.propose([7, 7]) == []  # too short to hold a match of 2 and its suffix


# ---------------------------------------------------------------- acceptance
def test_greedy_acceptance_keeps_the_agreeing_prefix_and_the_targets_next_token():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept_greedy([5, 6, 7], [1, 6, 7, 8]) == [1]
    assert accept_greedy([], [4]) == [4]


def test_sampled_acceptance_of_certain_and_impossible_drafts():
    gen = torch.Generator().manual_seed(0)
    sure = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    for _ in range(50):
        assert accept_sampled(sure, [1, 2], gen) == [1, 2, 0]
    never = torch.tensor([[0.5, 0.0, 0.5], [0.0, 1.0, 0.0]])
    for _ in range(50):  # rejected at once, and the replacement is never the draft
        out = accept_sampled(never, [1], gen)
        assert len(out) == 1 and out[0] in (0, 2)


def test_sampled_acceptance_preserves_the_target_distribution():
    """A point-mass draft must not bend the output: over 20000 steps the first token is
    distributed as p0 whatever the draft, and the second (given the first was the draft)
    as p1. Bounded: a chi-square test at p < 1e-6 (a fixed seed; it cannot flake)."""
    p0 = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p1 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    gen = torch.Generator().manual_seed(1234)
    n = 20_000
    for draft_first in (0, 1, 3):
        probs = torch.stack([p0, p1])
        first: Counter[int] = Counter()
        second: Counter[int] = Counter()
        for _ in range(n):
            out = accept_sampled(probs, [draft_first], gen)
            first[out[0]] += 1
            if len(out) == 2:
                second[out[1]] += 1
        assert _chi2(first, p0) < CHI2_3DOF_1E6
        assert _chi2(second, p1) < CHI2_3DOF_1E6
        accepted = sum(second.values())  # acceptance rate is p0(draft)
        assert abs(accepted / n - float(p0[draft_first])) < 0.02


CHI2_3DOF_1E6 = 30.7  # chi-square, 3 degrees of freedom, upper tail 1e-6


def _chi2(counts: Counter[int], p: torch.Tensor) -> float:
    total = sum(counts.values())
    return sum((counts[i] - total * float(q)) ** 2 / (total * float(q)) for i, q in enumerate(p))


# ---------------------------------------------------------------- the draft's length
def test_odds_count_the_first_token_and_each_token_after_one_that_held():
    odds = DraftOdds()
    assert odds.rates() == (0.5, 0.5)  # nothing seen: the uniform prior
    odds.add(drafted=4, accepted=2)  # tokens 1, 2 held, 3 rejected: 2 tried after a hold
    assert (odds.first_held, odds.first_tried) == (1, 1)
    assert (odds.next_held, odds.next_tried) == (1, 2)
    odds.add(drafted=4, accepted=4)  # all held: 3 tried after a hold, 3 held
    assert odds.next_held == pytest.approx(7 / 8 + 3) and odds.next_tried == pytest.approx(
        2 * 7 / 8 + 3
    )
    odds.add(drafted=3, accepted=0)  # the first token failed: nothing tried after it
    assert odds.first_held == pytest.approx((7 / 8 + 1) * 7 / 8)
    assert odds.first_tried == pytest.approx((7 / 8 + 1) * 7 / 8 + 1)
    assert odds.next_tried == pytest.approx((2 * 7 / 8 + 3) * 7 / 8)
    copied = DraftOdds()
    for _ in range(20):
        copied.add(drafted=8, accepted=8)
    p_first, p_next = copied.rates()
    assert p_first > 0.85 and p_next > 0.95
    # expected tokens: 1 without a draft, + p_first, + p_first * p_next, ...
    assert expected_tokens((0.5, 0.8), 3) == pytest.approx([1, 1.5, 1.9, 2.22])


def test_step_cost_fits_a_line_through_each_row_counts_median():
    cost = StepCost(window=5, max_sizes=3)
    assert cost.line() is None
    for ms in (4.3, 4.2, 40.0, 4.4, 4.3):  # one step the host stole the CPU from
        cost.observe(1, ms)
    assert cost.line() is None  # one row count: nothing says what a row costs
    for ms in (7.9, 8.0, 7.8):
        cost.observe(5, ms)
    fixed, per_row = cost.line()
    assert per_row == pytest.approx((7.9 - 4.3) / 4) and fixed == pytest.approx(4.3 - per_row)
    cost.observe(9, 11.5)
    cost.observe(13, 15.1)  # a fourth row count: the least recently seen (1 row) goes
    fixed, per_row = cost.line()
    assert per_row == pytest.approx(0.9) and fixed == pytest.approx(3.4)
    flat = StepCost()
    flat.observe(1, 5.0)
    flat.observe(4, 4.0)
    assert flat.line() is None  # rows that cost nothing (or less): no basis to weigh drafts


LINE = (3.4, 0.9)  # SmolLM2 int4 at batch 1 on this CPU: 4.3 ms a plain step, 7.9 ms 5 rows


def test_the_length_is_what_pays_by_the_odds_and_the_step_it_rides_on():
    copying, paraphrasing, failing = (0.95, 0.98), (0.5, 0.6), (0.15, 0.5)
    assert best_length(copying, 16, LINE, seqs=1, rows=1) == 16  # a copied span: all of it
    assert best_length(copying, 4, LINE, seqs=1, rows=1) == 4
    assert best_length(paraphrasing, 16, LINE, seqs=1, rows=1) in (1, 2)  # short drafts
    assert best_length(failing, 16, LINE, seqs=1, rows=1) == 0  # plain steps emit more
    # in a batch of 32 a row costs about what a plain token does: only near-certain drafts
    assert best_length(paraphrasing, 16, LINE, seqs=32, rows=32) == 0
    assert best_length(copying, 16, LINE, seqs=32, rows=32) > 0
    # against the rate itself: k maximises (seqs - 1 + E[tokens]) / (fixed + per_row * rows)
    for rates in (copying, paraphrasing, failing):
        e = expected_tokens(rates, 16)
        rate = [e[k] / (LINE[0] + LINE[1] * (1 + k)) for k in range(17)]
        assert best_length(rates, 16, LINE, seqs=1, rows=1) == rate.index(max(rate))


def adaptive_core(line: tuple[float, float] | None = LINE, **kw: object) -> EngineCore:
    core = tiny_core(spec_method="ngram", spec_tokens=8, **kw)
    assert core.speculator is not None
    assert core.speculator.adaptive == (kw.get("spec_length", "adaptive") == "adaptive")
    if line is not None:  # the tiny model's own step times would decide otherwise
        core.speculator.cost.line = lambda: line  # type: ignore[method-assign]
    return core


def verified_drafts(core: EngineCore) -> list[tuple[str, int]]:
    """(request id, draft length) of every decoding step the speculator records from now
    on (0: a step without a draft)."""
    log: list[tuple[str, int]] = []
    real = core.speculator.record

    def record(seq: Sequence, emitted: int) -> None:
        log.append((seq.request_id, len(seq.draft_token_ids)))
        real(seq, emitted)

    core.speculator.record = record  # type: ignore[method-assign]
    return log


def test_adaptive_drafts_lengthen_while_they_hold_and_stop_when_they_fail():
    """Drafts that always hold grow to k; drafts whose first token always fails stop (the
    backoff, then the odds), with a one-token probe now and then; fixed k verifies k rows
    every time the backoff lets it. Output is the plain one either way."""
    ref = reference(max_tokens=48)
    core = adaptive_core()
    ScriptedDrafts(core, {"a": (PROMPTS["a"], ref["a"])}, k=8)
    log = verified_drafts(core)
    out, _ = run(core, [request("a", PROMPTS["a"], max_tokens=48)])
    assert out["a"] == ref["a"]
    drafted = [n for _, n in log if n]
    assert drafted[0] < 8 and 8 in drafted and drafted[-2] == 8  # longer as they held

    failing = {}
    for length in ("adaptive", "fixed"):
        core = adaptive_core(spec_length=length)
        ScriptedDrafts(core, {"a": (PROMPTS["a"], ref["a"])}, k=8, wrong_first=True)
        log = verified_drafts(core)
        out, _ = run(core, [request("a", PROMPTS["a"], max_tokens=48)])
        assert out["a"] == ref["a"]
        failing[length] = [n for _, n in log]
    # after 1, 2, 4, 8, 16 skipped steps: k rows each
    assert sum(failing["fixed"]) >= 8 * 4
    # one-token probes while the odds say a token may still hold (about 1 in 5), then none
    assert max(failing["adaptive"]) == 1 and sum(failing["adaptive"]) <= 6


def test_the_engine_times_the_steps_that_only_decode():
    """What a row costs is fitted from steps of decode rows (plain, or verifying a draft),
    not from steps with a prefill chunk, whose rows cost more than decode rows."""
    ref = reference()
    core = tiny_core(spec_method="ngram", spec_length="fixed", max_num_batched_tokens=8)
    ScriptedDrafts(core, {"a": (PROMPTS["a"], ref["a"])}, wrong_every=2)
    timed: list[int] = []
    steps: list[tuple[bool, int]] = []  # (has a prefill chunk, rows) of each step run
    real_observe, real_run = core.speculator.observe_step, core.runner.run

    def run_step(batch, block_manager):  # type: ignore[no-untyped-def]
        prefill = any(
            n > 1 and not seq.draft_token_ids
            for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
        )
        steps.append((prefill, sum(batch.num_new_tokens)))
        return real_run(batch, block_manager)

    core.runner.run = run_step  # type: ignore[method-assign]
    core.speculator.observe_step = lambda rows, ms: timed.append(rows) or real_observe(rows, ms)
    run(core, [request("a", PROMPTS["a"], max_tokens=24), request("c", PROMPTS["c"])])
    assert sum(prefill for prefill, _ in steps) == 2  # 7 + 5 prompt tokens, 8 a step
    assert timed == [rows for prefill, rows in steps if not prefill]
    assert max(timed) > 2  # verifying steps among them


def test_a_sequence_whose_drafts_stopped_paying_probes_one_token_now_and_then():
    """The odds move only by drafting: a sequence the length policy stopped drafting for
    verifies a one-token draft after MAX_BACKOFF_STEPS plain steps."""
    core = adaptive_core()
    ScriptedDrafts(core, {"p": (PROMPTS["a"], list(range(100, 300)))}, k=8)
    core.add(request("p", PROMPTS["a"], max_tokens=200))
    core.step()  # the prefill
    seq = core.seqs["p"]
    for _ in range(12):
        seq.spec_odds.add(4, 0)
    speculator, drafts = core.speculator, []
    for _ in range(2 * MAX_BACKOFF_STEPS + 3):
        drafts.append(speculator.draft(seq, 64))
        if drafts[-1]:  # verified, nothing held: the backoff skips one step, then idle again
            seq.draft_token_ids = drafts[-1]
            speculator.record(seq, 1)
            seq.draft_token_ids = []
    probes = [i for i, d in enumerate(drafts) if d]
    assert probes == [MAX_BACKOFF_STEPS, 2 * MAX_BACKOFF_STEPS + 2]
    assert all(len(drafts[i]) == 1 for i in probes)


def test_in_a_full_batch_only_a_sequence_whose_drafts_hold_drafts():
    """Eight sequences decode together; the seven whose drafts held one time in three decode
    plainly (at batch 8 a verified row costs most of what a plain token does), the one whose
    drafts always held drafts. Alone, a sequence with those one-in-three odds drafts."""
    one_in_three = DraftOdds()
    for i in range(12):
        one_in_three.add(4, 4 if i % 3 == 0 else 0)
    assert best_length(one_in_three.rates(), 4, LINE, seqs=1, rows=1) > 0
    ref = reference(max_tokens=24)
    core = adaptive_core(max_num_batched_tokens=128)
    prompts = {f"s{i}": PROMPTS["a"] for i in range(8)}
    ScriptedDrafts(core, {"a": (PROMPTS["a"], ref["a"])}, k=4)
    log = verified_drafts(core)
    reqs = [request(rid, p, max_tokens=24) for rid, p in prompts.items()]
    for r in reqs:
        core.add(r)
    core.step()  # the prefills
    for seq in core.seqs.values():  # their history: s0's drafts always held
        seq.spec_odds = DraftOdds() if seq.request_id == "s0" else copy.copy(one_in_three)
        for _ in range(12 if seq.request_id == "s0" else 0):
            seq.spec_odds.add(4, 4)
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while core.has_work():
        for rid, o in core.step():
            out[rid] += o.token_ids
    assert all(tokens == ref["a"][1:] for tokens in out.values())
    verified: Counter[str] = Counter()
    for rid, n in log:
        verified[rid] += n
    assert verified["s0"] > 0 and sum(verified.values()) == verified["s0"]


# ---------------------------------------------------------------- the engine, scripted drafts
class ScriptedDrafts:
    """Drafts from a known continuation (as a perfect n-gram match would), with chosen
    positions corrupted: exact control over acceptance and rejection."""

    def __init__(
        self,
        core: EngineCore,
        reference: dict[str, tuple[list[int], list[int]]],
        wrong_every: int = 0,
        *,
        k: int = 4,
        wrong_first: bool = False,
    ):
        self.reference, self.wrong_every, self.k = reference, wrong_every, k
        self.wrong_first = wrong_first
        assert core.speculator is not None
        core.speculator.proposer = self  # type: ignore[assignment]
        self.seqs: dict[int, str] = {}
        self.calls = 0

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        for ref in self.reference.values():
            n = len(token_ids) - len(ref[0])
            if n >= 0 and token_ids[: len(ref[0])] == ref[0]:
                draft = ref[1][n : n + min(self.k, max_tokens or self.k)]
                self.calls += 1
                if self.wrong_every and self.calls % self.wrong_every == 0 and len(draft) > 1:
                    draft[1] = (draft[1] + 1) % 256
                if self.wrong_first and draft:
                    draft[0] = (draft[0] + 1) % 256
                return draft
        return []


def run(core: EngineCore, reqs: list[PreprocessedRequest]) -> tuple[dict[str, list[int]], dict]:
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    reasons: dict[str, str] = {}
    for r in reqs:
        core.add(r)
    while core.has_work():
        for rid, o in core.step():
            out[rid] += o.token_ids
            if o.finish_reason:
                reasons[rid] = o.finish_reason
        core.block_manager.check_integrity()
    assert core.block_manager.num_active_blocks == 0
    return out, reasons


PROMPTS = {"a": [5, 6, 7, 8, 9, 10, 11], "b": [20, 21, 22], "c": [30, 31, 32, 33, 34]}


def reference(max_tokens: int = 24) -> dict[str, list[int]]:
    out, _ = run(tiny_core(), [request(r, p, max_tokens=max_tokens) for r, p in PROMPTS.items()])
    return out


@pytest.mark.parametrize("length", ["fixed", "adaptive"])
@pytest.mark.parametrize("wrong_every", [0, 3, 1])
def test_greedy_output_with_drafts_equals_plain_decoding(wrong_every, length):
    """Right drafts, some wrong, every draft wrong: the same tokens, the blocks of rejected
    positions given back (integrity after every step, none held at the end), and only
    committed tokens in the prefix cache's blocks; with drafts of every length the adaptive
    policy chooses."""
    ref = reference()
    core = tiny_core(spec_method="ngram", spec_length=length, num_blocks=24)
    ScriptedDrafts(core, {r: (PROMPTS[r], ref[r]) for r in PROMPTS}, wrong_every)
    out, reasons = run(core, [request(r, p, max_tokens=24) for r, p in PROMPTS.items()])
    assert out == ref and set(reasons.values()) == {"length"}
    stats = core.speculator.stats
    assert stats.num_drafts > 0
    if wrong_every == 0:
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert stats.tokens_per_step > (3 if length == "fixed" else 1)
    for event in core.take_events():
        if isinstance(event, BlockStored):
            seqs = [PROMPTS[r] + ref[r] for r in PROMPTS]
            assert any(_contains(s, event.token_ids) for s in seqs), event


def _contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i : i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def test_max_tokens_and_stop_ids_inside_an_accepted_run_end_it_there():
    ref = reference(max_tokens=40)
    stop_at = 9  # the 10th token of "a" becomes a stop id
    stop_token = ref["a"][stop_at]
    assert stop_token not in ref["a"][:stop_at]
    core = tiny_core(spec_method="ngram", spec_length="fixed")
    drafts = ScriptedDrafts(core, {r: (PROMPTS[r], ref[r]) for r in PROMPTS})
    a = request("a", PROMPTS["a"], max_tokens=40)
    a.stop.stop_token_ids = [stop_token]
    out, reasons = run(core, [a, request("b", PROMPTS["b"], max_tokens=7)])
    assert out["a"] == ref["a"][: stop_at + 1] and reasons["a"] == "stop"
    assert out["b"] == ref["b"][:7] and reasons["b"] == "length"
    assert drafts.calls > 0


def test_a_mixed_batch_drafts_only_where_sampling_allows():
    """Penalties, logit_bias, logprobs and structured output decode without drafts in the
    same steps as drafting sequences; each gets what it gets without speculation."""
    reqs = {
        "a": {},
        "pen": {"presence_penalty": 0.5},
        "bias": {"logit_bias": {9: 5.0}},
        "lp": {"logprobs": 2},
    }
    prompt = PROMPTS["a"]

    def make() -> list[PreprocessedRequest]:
        return [request(r, prompt, max_tokens=16, **kw) for r, kw in reqs.items()]

    plain, _ = run(tiny_core(), make())
    core = tiny_core(spec_method="ngram", spec_length="fixed")
    drafted: list[str] = []
    real = core.speculator.draft

    def draft(seq: Sequence, budget: int, **step: int) -> list[int]:
        d = real(seq, budget, **step)
        if d:
            drafted.append(seq.request_id)
        return d

    core.scheduler.draft = draft
    ScriptedDrafts(core, {"a": (prompt, plain["a"])})
    out, _ = run(core, make())
    assert out == plain
    assert set(drafted) == {"a"}


def test_sampling_with_drafts_runs_seeded_and_deterministic():
    ref = reference()
    outs = []
    for _ in range(2):
        core = tiny_core(spec_method="ngram", spec_length="fixed")
        ScriptedDrafts(core, {r: (PROMPTS[r], ref[r]) for r in PROMPTS}, wrong_every=2)
        reqs = [
            request(r, p, max_tokens=24, temperature=0.8, top_k=50, seed=7)
            for r, p in PROMPTS.items()
        ]
        out, reasons = run(core, reqs)
        assert all(len(t) == 24 for t in out.values()) and set(reasons.values()) == {"length"}
        assert core.speculator.stats.num_drafts > 0
        outs.append(out)
    assert outs[0] == outs[1]


def test_without_a_draft_a_decode_is_the_plain_one_row_step(monkeypatch):
    """No n-gram recurs: every decode step is the plain batch-1 step (`decode_one`), no
    verification forward, and each step emits one token."""
    core = tiny_core(spec_method="ngram", spec_ngram_min=3)
    core.speculator.proposer = NgramProposer(4, 3, 4)
    calls = Counter[str]()
    model = core.runner.model
    real_one, real_hidden = model.decode_one, model.hidden
    monkeypatch.setattr(model, "decode_one", lambda *a: calls.update(["one"]) or real_one(*a))
    monkeypatch.setattr(model, "hidden", lambda *a: calls.update(["batch"]) or real_hidden(*a))
    prompt = [40, 41, 42, 43, 44, 45]
    out, _ = run(core, [request("u", prompt, max_tokens=6)])
    assert not any(
        NgramProposer(4, 3, 4).propose(prompt + out["u"][:i]) for i in range(len(out["u"]))
    ), "pick a prompt whose output repeats no 3-gram"
    stats = core.speculator.stats
    assert stats.num_drafts == 0 and stats.tokens_per_step == 1.0
    assert calls == {"batch": 1, "one": 5}  # the prefill, then five plain decode steps


def test_metrics_say_acceptance_and_tokens_per_step():
    ref = reference()
    core = tiny_core(spec_method="ngram", spec_length="fixed")
    ScriptedDrafts(core, {"a": (PROMPTS["a"], ref["a"])}, wrong_every=2)
    run(core, [request("a", PROMPTS["a"], max_tokens=24)])
    families = {f.name: f for f in text_families(core.prometheus_lines())}
    s = core.speculator.stats
    rate = families["tandem_native_spec_acceptance_rate"].samples[0].value
    assert 0 < rate < 1 and rate == pytest.approx(s.num_accepted_tokens / s.num_draft_tokens)
    tps = families["tandem_native_spec_tokens_per_step"].samples[0].value
    assert tps > 1
    drafts = families["tandem_native_spec_draft_tokens"].samples[0].value
    assert drafts == s.num_draft_tokens > 0
    core.speculator.cost.line = lambda: (3.4, 0.9)  # what the length policy weighs drafts by
    families = {f.name: f for f in text_families(core.prometheus_lines())}
    assert families["tandem_native_spec_step_fixed_ms"].samples[0].value == 3.4
    assert families["tandem_native_spec_step_row_ms"].samples[0].value == 0.9
    assert tiny_core().prometheus_lines() == []  # speculation off: no series


# ---------------------------------------------------------------- flags
def parse(*argv: str) -> NativeConfig:
    parser = argparse.ArgumentParser()
    add_args(parser)
    return config_from_args(parser.parse_args(["--weights", "fp32", *argv]))


def test_flags_turn_it_on_and_bad_values_are_clear_errors():
    assert parse().spec_method == "none"
    config = parse("--spec-method", "ngram", "--spec-tokens", "6", "--spec-ngram-max", "5")
    assert (config.spec_method, config.spec_tokens, config.spec_ngram_max) == ("ngram", 6, 5)
    with pytest.raises(ValueError, match="spec_method='eagle'; expected one of: none, ngram"):
        parse("--spec-method", "eagle")
    assert config.spec_length == "adaptive"
    assert parse("--spec-method", "ngram", "--spec-length", "fixed").spec_length == "fixed"
    with pytest.raises(ValueError, match="spec_length='auto'; expected one of: adaptive, fixed"):
        parse("--spec-method", "ngram", "--spec-length", "auto")
    with pytest.raises(ValueError, match="spec_tokens=0 out of range"):
        parse("--spec-method", "ngram", "--spec-tokens", "0")
    with pytest.raises(ValueError, match="spec_ngram_max=2 out of range"):
        parse("--spec-ngram-min", "3", "--spec-ngram-max", "2")


async def test_the_engine_serves_the_speculation_series_with_its_metrics():
    """What a worker's /metrics scrape reads (`Engine.metric_families`)."""
    core = tiny_core(spec_method="ngram", spec_length="fixed")
    engine = NativeEngine(core.config, core=core)
    await engine.start()
    async for out in engine.generate(request("m", PROMPTS["a"], max_tokens=4)):
        if out.finish_reason:
            break
    names = {f.name for f in engine.metric_families()}
    await engine.stop()
    assert {"tandem_native_spec_acceptance_rate", "tandem_native_spec_decode_steps"} <= names
    assert core.speculator.stats.num_decode_steps == 3
