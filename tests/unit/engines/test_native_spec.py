"""Prompt-lookup speculative decoding in the native engine (engines/native/speculation.py):
the n-gram drafter, the acceptance rules, and the engine with drafts (a tiny model with
scripted drafts for exact control; SmolLM2's real output in test_native_spec_smollm2.py)."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest
import torch
from native_tiny import request, tiny_core

from tandem.engines.native.args import add_args, config_from_args
from tandem.engines.native.config import NativeConfig
from tandem.engines.native.engine import NativeEngine
from tandem.engines.native.engine_core import EngineCore
from tandem.engines.native.sequence import Sequence
from tandem.engines.native.speculation import NgramProposer, accept_greedy, accept_sampled
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


# ---------------------------------------------------------------- the engine, scripted drafts
class ScriptedDrafts:
    """Drafts from a known continuation (as a perfect n-gram match would), with chosen
    positions corrupted: exact control over acceptance and rejection."""

    def __init__(self, core: EngineCore, reference: dict[str, list[int]], wrong_every: int = 0):
        self.reference, self.wrong_every = reference, wrong_every
        assert core.speculator is not None
        core.speculator.proposer = self  # type: ignore[assignment]
        self.seqs: dict[int, str] = {}
        self.calls = 0

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        for ref in self.reference.values():
            n = len(token_ids) - len(ref[0])
            if n >= 0 and token_ids[: len(ref[0])] == ref[0]:
                draft = ref[1][n : n + min(4, max_tokens or 4)]
                self.calls += 1
                if self.wrong_every and self.calls % self.wrong_every == 0 and len(draft) > 1:
                    draft[1] = (draft[1] + 1) % 256
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


@pytest.mark.parametrize("wrong_every", [0, 3, 1])
def test_greedy_output_with_drafts_equals_plain_decoding(wrong_every):
    """Right drafts, some wrong, every draft wrong: the same tokens, the blocks of rejected
    positions given back (integrity after every step, none held at the end), and only
    committed tokens in the prefix cache's blocks."""
    ref = reference()
    core = tiny_core(spec_method="ngram", num_blocks=24)
    ScriptedDrafts(core, {r: (PROMPTS[r], ref[r]) for r in PROMPTS}, wrong_every)
    out, reasons = run(core, [request(r, p, max_tokens=24) for r, p in PROMPTS.items()])
    assert out == ref and set(reasons.values()) == {"length"}
    stats = core.speculator.stats
    assert stats.num_drafts > 0
    if wrong_every == 0:
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert stats.tokens_per_step > 3
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
    core = tiny_core(spec_method="ngram")
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
    core = tiny_core(spec_method="ngram")
    drafted: list[str] = []
    real = core.speculator.draft

    def draft(seq: Sequence, budget: int) -> list[int]:
        d = real(seq, budget)
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
        core = tiny_core(spec_method="ngram")
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
    core = tiny_core(spec_method="ngram")
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
    with pytest.raises(ValueError, match="spec_tokens=0 out of range"):
        parse("--spec-method", "ngram", "--spec-tokens", "0")
    with pytest.raises(ValueError, match="spec_ngram_max=2 out of range"):
        parse("--spec-ngram-min", "3", "--spec-ngram-max", "2")


async def test_the_engine_serves_the_speculation_series_with_its_metrics():
    """What a worker's /metrics scrape reads (`Engine.metric_families`)."""
    core = tiny_core(spec_method="ngram")
    engine = NativeEngine(core.config, core=core)
    await engine.start()
    async for out in engine.generate(request("m", PROMPTS["a"], max_tokens=4)):
        if out.finish_reason:
            break
    names = {f.name for f in engine.metric_families()}
    await engine.stop()
    assert {"tandem_native_spec_acceptance_rate", "tandem_native_spec_decode_steps"} <= names
    assert core.speculator.stats.num_decode_steps == 3
