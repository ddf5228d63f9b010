"""Tokens-in generate on the real SmolLM2 native engine: token-exact with /v1/completions
given the same ids as its prompt, a chat body rendered (`/v1/chat/completions/render`) and
posted to `/inference/v1/generate` generates what the chat completion does, and each
`sampling_params` field has its effect (the field rule of
`tests/integration/test_openai_field_rule.py`, for this endpoint: the refusals are in
`test_frontend_generate_tokens.py`)."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import pytest
from tests.support.frontend_stack import CHAT, COMPLETIONS, FrontendStack
from tests.support.smollm2 import smollm2_gguf

from tandem.engines.native.config import NativeConfig
from tandem.engines.native.engine import NativeEngine
from tandem.protocols.tokens_generate import GenerateSamplingParams
from tandem.tokens.tokenizer import load_tokenizer

pytestmark = [pytest.mark.native, pytest.mark.timeout(240)]
MODEL = "smollm2"
GENERATE = "/inference/v1/generate"
MESSAGES = [{"role": "user", "content": "Write the word cat twenty times."}]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 8}


async def _generate(s: FrontendStack, ids: list[int], **sampling: Any) -> dict[str, Any]:
    body = {"model": MODEL, "token_ids": ids, "sampling_params": {**GREEDY, **sampling}}
    status, out, _ = await s.post(GENERATE, body)
    assert status == 200, out
    return dict(out)


def _ids(out: dict[str, Any], i: int = 0) -> list[int]:
    return list(out["choices"][i]["token_ids"])


async def test_token_exact_with_completions_render_and_every_sampling_field() -> None:
    tok = load_tokenizer(f"gguf:{smollm2_gguf()}")
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        config = NativeConfig(num_blocks=256, max_num_batched_tokens=256, num_threads=1)
        await s.add_worker(NativeEngine(config))
        await s.start_frontend({"model": MODEL, "messages": MESSAGES, "max_tokens": 1})
        prompt = tok.encode("Write the word cat twenty times: cat cat cat cat")

        # the same ids as a completions prompt: the same tokens, the same logprobs
        gen = await _generate(s, prompt, logprobs=1)
        status, text, _ = await s.post(
            COMPLETIONS, {"model": MODEL, "prompt": prompt, **GREEDY, "logprobs": 1}
        )
        assert status == 200, text
        ids = _ids(gen)
        assert len(ids) == 8 == text["usage"]["completion_tokens"]
        assert tok.decode(ids) == text["choices"][0]["text"]
        content = gen["choices"][0]["logprobs"]["content"]
        assert [c["token"] for c in content] == [f"token_id:{t}" for t in ids]
        assert [c["logprob"] for c in content] == text["choices"][0]["logprobs"]["token_logprobs"]
        assert all(len(c["top_logprobs"]) == 1 for c in content)

        # chat → render → generate: the chat completion's answer, as ids
        chat_body = {"model": MODEL, "messages": MESSAGES, **GREEDY}
        status, chat, _ = await s.post(CHAT, chat_body)
        status, rendered, _ = await s.post("/v1/chat/completions/render", chat_body)
        assert status == 200, rendered
        assert len(rendered["token_ids"]) == chat["usage"]["prompt_tokens"]
        status, out, _ = await s.post(GENERATE, rendered)
        assert status == 200, out
        assert tok.decode(_ids(out)) == chat["choices"][0]["message"]["content"]

        # every sampling field: its effect (refusals: test_frontend_generate_tokens.py)
        done = {"max_tokens", "temperature", "ignore_eos", "logprobs"}
        biased = await _generate(s, prompt, logit_bias={str(ids[0]): -100})
        assert _ids(biased)[0] != ids[0]
        for field in ("frequency_penalty", "presence_penalty"):
            assert _ids(await _generate(s, prompt, **{field: 2.0})) != ids, field
        assert _ids(await _generate(s, prompt, repetition_penalty=1.5)) != ids
        hot = {"temperature": 1.8, "seed": 11}
        sampled = _ids(await _generate(s, prompt, **hot))
        assert sampled != ids and _ids(await _generate(s, prompt, **hot)) == sampled
        assert _ids(await _generate(s, prompt, **hot, top_p=1e-6)) == ids
        assert _ids(await _generate(s, prompt, **hot, top_k=1)) == ids
        two = await _generate(s, prompt, **hot, n=2)
        assert len(two["choices"]) == 2 and _ids(two, 0) == sampled  # choice i: seed + i
        stop_id = ids[3]
        stopped = await _generate(s, prompt, stop_token_ids=[stop_id])
        assert _ids(stopped) == ids[: ids.index(stop_id) + 1]
        assert stopped["choices"][0]["finish_reason"] == "stop"
        late = await _generate(s, prompt, stop_token_ids=[ids[0]], min_tokens=4)
        assert len(_ids(late)) > 1  # min_tokens holds the stop id back
        word = tok.decode(ids[4:6])  # a stop string ends the choice at the token completing it
        cut = await _generate(s, prompt, stop=[word])
        assert word in tok.decode(_ids(cut)) and word not in tok.decode(_ids(cut)[:-1])
        assert cut["choices"][0]["finish_reason"] == "stop"
        eos_first = {"logit_bias": {str(tok.eos_token_ids[0]): 100}, "max_tokens": 3}
        ended = await _generate(s, prompt, **eos_first, ignore_eos=False)
        assert _ids(ended) == [tok.eos_token_ids[0]]
        assert ended["choices"][0]["finish_reason"] == "stop"
        assert len(_ids(await _generate(s, prompt, **eos_first))) == 3  # ignore_eos
        done |= {"logit_bias", "frequency_penalty", "presence_penalty", "repetition_penalty"}
        done |= {"seed", "top_p", "top_k", "n", "stop_token_ids", "min_tokens", "stop"}
        # fields about text (none is returned) and vLLM's own defaults: accepted, no effect
        text_only = {
            "detokenize": False,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "include_stop_str_in_output": True,
            "output_kind": 1,
            "skip_clone": True,
        }
        assert _ids(await _generate(s, prompt, **text_only)) == ids
        done |= set(text_only)
        refused = {"min_p", "prompt_logprobs", "allowed_token_ids", "bad_words"}
        refused |= {"structured_outputs", "logits_processors", "extra_args"}
        refused |= {"truncate_prompt_tokens", "flat_logprobs", "logprob_token_ids"}
        refused |= {"prompt_logprob_token_ids", "prompt_logprob_start", "stream_interval"}
        refused |= {"skip_reading_prefix_cache", "thinking_token_budget", "watermarking"}
        refused |= {"repetition_detection", "routed_experts_prompt_start"}
        refused |= {"trace_decode_token_ids", "output_text_buffer_length"}
        derived = {"all_stop_token_ids", "bad_words_token_ids", "eos_token_id"}
        derived |= {"watermarking_skipped"}  # vLLM-internal, derived: not read (by vLLM either)
        assert set(GenerateSamplingParams.__struct_fields__) == done | refused | derived
