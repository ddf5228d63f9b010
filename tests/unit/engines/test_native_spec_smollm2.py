"""Prompt-lookup speculation on the real SmolLM2 (fp32 and int4): greedy output token for
token what plain decoding gives, alone and in a mixed batch where some sequences draft and
others do not; drafts accepted where the answer quotes the prompt."""

from __future__ import annotations

import pytest
import torch

from tandem.bench.component.spec_workloads import CHAT_TASKS, QUOTE_TASKS, chat_prompts
from tandem.engines.native.config import NativeConfig
from tandem.engines.native.engine import build_model
from tandem.engines.native.engine_core import EngineCore
from tandem.engines.native.loader import default_model_path
from tandem.engines.native.model import LlamaModel
from tandem.protocols.engine import PreprocessedRequest, SamplingParams, StopConditions
from tandem.tokens.tokenizer import load_tokenizer

pytestmark = [pytest.mark.native, pytest.mark.timeout(300)]

MAX_TOKENS = 32
FORMATS = ("fp32", "int4")


@pytest.fixture(scope="module")
def models() -> dict[str, LlamaModel]:
    torch.set_num_threads(2)
    return {f: build_model(NativeConfig(weights=f, max_model_len=1024))[0] for f in FORMATS}


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    tok = load_tokenizer("gguf:" + default_model_path())
    ids = chat_prompts(tok, (QUOTE_TASKS[0], QUOTE_TASKS[2], CHAT_TASKS[0]))
    return dict(zip(("quote", "code", "chat"), ids, strict=True))


def generate(
    model: LlamaModel, fmt: str, reqs: dict[str, tuple[list[int], SamplingParams]], **spec: object
) -> tuple[dict[str, list[int]], EngineCore]:
    config = NativeConfig(weights=fmt, num_blocks=128, max_model_len=1024, **spec)  # type: ignore[arg-type]
    core = EngineCore(config, model)
    for rid, (prompt, sampling) in reqs.items():
        stop = StopConditions(max_tokens=MAX_TOKENS)
        core.add(PreprocessedRequest(request_id=rid, model="m", token_ids=prompt,
                                     sampling=sampling, stop=stop))  # fmt: skip
    out: dict[str, list[int]] = {rid: [] for rid in reqs}
    while core.has_work():
        for rid, chunk in core.step():
            out[rid] += chunk.token_ids
        core.block_manager.check_integrity()
    assert core.block_manager.num_active_blocks == 0
    return out, core


GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_speculation_is_token_identical_at_batch_1(models, prompts, fmt):
    for name in ("quote", "code"):
        reqs = {name: (prompts[name], GREEDY)}
        plain, _ = generate(models[fmt], fmt, reqs)
        spec, core = generate(models[fmt], fmt, reqs, spec_method="ngram")
        assert spec == plain, name
        stats = core.speculator.stats
        if name == "quote":  # the answer is the prompt's text: most drafts hold
            assert stats.acceptance_rate > 0.5 and stats.tokens_per_step > 2, stats


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_speculation_is_token_identical_in_a_mixed_batch(models, prompts, fmt):
    """Drafting sequences (quote, code), one that drafts rarely (chat) and one that never
    may (a presence penalty) share every step; each equals its plain-decoding output."""
    reqs = {name: (ids, GREEDY) for name, ids in prompts.items()}
    reqs["penalty"] = (prompts["chat"], SamplingParams(temperature=0.0, presence_penalty=0.5))
    plain, _ = generate(models[fmt], fmt, reqs)
    spec, core = generate(models[fmt], fmt, reqs, spec_method="ngram")
    assert spec == plain
    assert core.speculator.stats.num_accepted_tokens > 0
