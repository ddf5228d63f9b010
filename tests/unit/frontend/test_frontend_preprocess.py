from __future__ import annotations

import msgspec
import pytest

from tandem.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound, Overloaded
from tandem.frontend import errors as http_errors
from tandem.frontend.models import ServedModel
from tandem.frontend.pipeline.preprocess import (
    preprocess_chat,
    preprocess_completion,
    resolve_max_tokens,
)
from tandem.protocols.discovery import ModelCard
from tandem.protocols.openai import ChatCompletionRequest, CompletionRequest, StreamOptions
from tandem.router.source import StaticInstanceSet
from tandem.tokens.chat_template import ChatTemplate
from tandem.tokens.tokenizer import ModelTokenizer


@pytest.fixture
def model(smollm2) -> ServedModel:
    card = ModelCard(name="m", context_length=64, block_size=16, num_total_blocks=8)
    served = ServedModel(card, router=None, instances=StaticInstanceSet())  # type: ignore[arg-type]
    served.tokenizer = smollm2
    served.chat_template = ChatTemplate(smollm2.chat_template)
    served.eos_token_ids = [2]
    return served


def _chat(**kw) -> ChatCompletionRequest:
    kw.setdefault("messages", [{"role": "user", "content": "hi"}])
    return ChatCompletionRequest(model="m", **kw)


async def _pre_chat(model, req):
    return await preprocess_chat(req, model, request_id="r", worker_id=None, deadline_s=None)


async def test_chat_resolves_sampling_stop_and_n(model) -> None:
    p = await _pre_chat(
        model,
        _chat(
            n=2,
            seed=5,
            temperature=0.0,
            top_k=-1,
            max_completion_tokens=7,
            stop="x",
            ignore_eos=True,
            min_tokens=2,
        ),
    )
    assert [r.request_id for r in p.requests] == ["r-0", "r-1"]
    assert [r.sampling.seed for r in p.requests] == [5, 6]
    r = p.requests[0]
    assert (r.sampling.temperature, r.sampling.top_k, r.stop.max_tokens) == (0.0, 0, 7)
    assert r.stop.ignore_eos and r.stop.min_tokens == 2 and r.eos_token_ids == [2]
    assert p.stop_strings == ["x"]
    assert r.token_ids == model.tokenizer.encode(
        model.chat_template.render([{"role": "user", "content": "hi"}]), add_special_tokens=False
    )


async def test_default_max_tokens_is_remaining_context(model) -> None:
    p = await _pre_chat(model, _chat())
    assert p.requests[0].stop.max_tokens == 64 - p.prompt_lens[0]


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_logprobs": 3}, "logprobs"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ],
)
async def test_bad_values_name_the_field(model, kw, param) -> None:
    with pytest.raises(InvalidRequest) as info:
        await _pre_chat(model, _chat(**kw))
    assert info.value.param == param


async def test_context_errors_carry_the_numbers(model) -> None:
    with pytest.raises(ContextLengthExceeded, match="prompt has 70 tokens; model context is 64"):
        await preprocess_completion(
            CompletionRequest(model="m", prompt=[1] * 70),
            model,
            request_id="r",
            worker_id=None,
            deadline_s=None,
        )
    with pytest.raises(ContextLengthExceeded) as info:
        resolve_max_tokens(10, 64, 100, "max_tokens", "prompt")
    assert (
        str(info.value)
        == "max_tokens=100 exceeds remaining context 54 (model limit 64 − prompt 10)"
    )


async def test_completion_prompt_forms(model) -> None:
    async def pre(prompt, n=1):
        return await preprocess_completion(
            CompletionRequest(model="m", prompt=prompt, n=n),
            model,
            request_id="r",
            worker_id="w1",
            deadline_s=None,
        )

    assert (await pre([5, 6])).requests[0].token_ids == [5, 6]
    multi = await pre(["a b", [9, 9]], n=2)
    assert [r.request_id for r in multi.requests] == ["r-0", "r-1", "r-2", "r-3"]
    assert multi.requests[2].token_ids == [9, 9]
    assert multi.requests[0].routing.worker_id == "w1"
    with pytest.raises(InvalidRequest) as info:
        await pre(["ok", [1, "x"]])
    assert info.value.param == "prompt[1]"
    with pytest.raises(InvalidRequest, match="out of range"):
        await pre([10**9])


def test_error_mapping_status_body_and_retry_after() -> None:
    exc = Overloaded("busy", retry_after_s=2.5)
    assert http_errors.error_status(exc) == 503
    assert http_errors.error_headers(exc) == [("retry-after", "3")]
    body = msgspec.json.decode(http_errors.error_body(ModelNotFound("no", param="model")))
    assert body == {
        "error": {
            "message": "no",
            "type": "model_not_found",
            "param": "model",
            "code": "model_not_found",
        }
    }
    raw = b'{"model": "m", "prompt": "x", "n": "two"}'
    try:
        msgspec.json.decode(raw, type=CompletionRequest)
    except msgspec.ValidationError as err:
        bad = http_errors.decode_error(err, raw)
    assert bad.param == "n" and "'two'" in bad.message


async def _pre_completion(model, **kw):
    req = CompletionRequest(model="m", **{"prompt": [5, 6], "max_tokens": 4, **kw})
    return await preprocess_completion(req, model, request_id="r", worker_id=None, deadline_s=None)


@pytest.mark.parametrize(
    ("kw", "param", "allowed"),
    [
        ({"seed": 2**64}, "seed", "[-2**63, 2**64 - 1]"),
        ({"seed": -(2**63) - 1}, "seed", "[-2**63, 2**64 - 1]"),
        ({"top_k": 2**70}, "top_k", "[1, 2147483647]"),
        ({"top_k": -2}, "top_k", "-1 or 0 (off)"),
        ({"min_tokens": 2**70}, "min_tokens", "[0, 2147483647]"),
        ({"min_tokens": 5}, "min_tokens", "max_tokens=4"),
        ({"max_tokens": 2**64}, "max_tokens", "[1, 2147483647]"),
        ({"stop_token_ids": [1, 2**70]}, "stop_token_ids[1]", f"[1]={2**70} is not a token"),
        ({"stop_token_ids": [1, 2**70]}, "stop_token_ids[1]", "[0, 49152)"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]", "stop_token_ids[0]=-1 is not"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]", "[0, 49152)"),
        ({"stop_token_ids": [49152]}, "stop_token_ids[0]", "[0]=49152 is not a token id"),
        ({"stop_token_ids": [49152]}, "stop_token_ids[0]", "vocab_size is 49152"),
        (
            {"stop_token_ids": [7, 49152, 3, -5, 2**40]},
            "stop_token_ids[1]",
            f"[1]=49152, stop_token_ids[3]=-5, stop_token_ids[4]={2**40} are not token ids",
        ),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids", "at most 1024"),
        ({"n": 2, "best_of": 1}, "best_of", "[n=2, 128]"),
        ({"n": 1, "best_of": 2, "stream": True}, "best_of", "best_of=n=1 when streaming"),
        ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"stream_options": StreamOptions(include_usage=True)}, "stream_options", "unless stream"),
        ({"frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
        ({"repetition_penalty": 0}, "repetition_penalty", "> 0"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "token ids as keys"),
        ({"logit_bias": {"5": 101}}, "logit_bias[5]", "[-100, 100]"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300"),
        ({"logit_bias": {"49152": 1}}, "logit_bias", "[0, 49152)"),
        ({"prompt": [[1, True]]}, "prompt[0]", "token ids"),
    ],
)
async def test_out_of_range_numbers_name_the_field_the_value_and_the_range(
    model, kw, param, allowed
) -> None:
    with pytest.raises(InvalidRequest) as info:
        await _pre_completion(model, **kw)
    assert info.value.param == param
    assert param.split("[")[0] in info.value.message and allowed in info.value.message


async def test_min_tokens_beyond_the_context_left_names_it(model) -> None:
    with pytest.raises(InvalidRequest, match="min_tokens=63 exceeds the 62 tokens of context"):
        await _pre_completion(model, max_tokens=None, min_tokens=63)


async def test_seeds_of_the_choices_wrap_at_64_bits(model) -> None:
    top = 2**64 - 1
    p = await _pre_completion(model, seed=top, n=3)
    assert [r.sampling.seed for r in p.requests] == [top, 0, 1]
    p = await _pre_completion(model, seed=-1, n=2)
    assert [r.sampling.seed for r in p.requests] == [-1, 0]
    assert (await _pre_completion(model, n=2, best_of=2)).requests[1].request_id == "r-1"


def test_bodies_that_are_not_utf8_or_nest_too_deeply_are_400s() -> None:
    raw = b'{"model": "m", "prompt": "ab\xff"}'
    try:
        msgspec.json.decode(raw, type=CompletionRequest)
    except (UnicodeDecodeError, msgspec.DecodeError) as err:  # msgspec < 0.23, >= 0.23
        bad = http_errors.decode_error(err, raw)
    assert bad.status_code == 400 and "not valid UTF-8 at byte 28" in bad.message
    # either form msgspec raises names the byte
    for err in (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
                msgspec.DecodeError("Invalid UTF-8 encoded string")):  # fmt: skip
        bad = http_errors.decode_error(err, raw)
        assert "not valid UTF-8 at byte 28 (after" in bad.message and bad.status_code == 400
    bad = http_errors.decode_error(msgspec.DecodeError("Input data was truncated"), b'{"a"')
    assert bad.message == "request body is not valid JSON: Input data was truncated"
    raw = b'{"model": "m", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    try:
        msgspec.json.decode(raw, type=CompletionRequest)
    except RecursionError as err:
        bad = http_errors.decode_error(err, raw)
    assert bad.status_code == 400 and "too deeply" in bad.message


async def test_a_prompt_without_tokens_is_refused_before_routing(model) -> None:
    with pytest.raises(InvalidRequest, match="prompt='' has no tokens") as info:
        await _pre_completion(model, prompt="")
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequest) as info:
        await _pre_completion(model, prompt=["a", ""])
    assert info.value.param == "prompt[1]"


async def test_penalties_and_logit_bias_reach_the_engine_request(model) -> None:
    prepared = await _pre_completion(
        model,
        presence_penalty=0.5,
        frequency_penalty=-1,
        repetition_penalty=1.3,
        logit_bias={"7": -100, "9": 2.5},
    )
    sampling = prepared.requests[0].sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -1.0)
    assert sampling.repetition_penalty == 1.3
    assert sampling.logit_bias == {7: -100.0, 9: 2.5}


async def test_best_of_fans_out_candidates_with_logprobs_for_ranking(model) -> None:
    prepared = await _pre_completion(model, n=2, best_of=3, seed=1)
    assert len(prepared.requests) == 3 and (prepared.best_of, prepared.n) == (3, 2)
    assert all(r.sampling.logprobs == 0 for r in prepared.requests)
    assert prepared.num_top_logprobs is None  # the client did not ask: stripped later


async def test_a_long_prompt_whose_words_are_cached_is_tokenized_without_a_thread(
    smollm2: ModelTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tokenizing in a thread buys fairness only at the GIL's switch interval, and its hop
    cost more than a cached prompt's encode: a long prompt runs inline while few of its words
    need BPE, and in the thread otherwise (then and for text without the word cache)."""
    import asyncio
    import dataclasses
    import random
    import re

    from tandem.frontend.pipeline import preprocess
    from tandem.tokens.ascii_encoder import AsciiByteLevelEncoder

    backend = smollm2.backend
    fresh = AsciiByteLevelEncoder.build(backend)  # a cold cache of its own
    tok = dataclasses.replace(smollm2, ascii_encoder=fresh)
    words = [
        " " + token[1:]
        for i in range(backend.get_vocab_size())
        if (token := backend.id_to_token(i) or "") and re.fullmatch("\u0120[a-z]+", token)
    ]
    text = "".join(random.Random(7).sample(words, 3000))
    assert len(text) > preprocess._THREAD_TOKENIZE_CHARS
    threaded: list[str] = []
    to_thread = asyncio.to_thread

    async def counting(fn, text, **kw):  # type: ignore[no-untyped-def]
        threaded.append(text)
        return await to_thread(fn, text, **kw)

    monkeypatch.setattr(preprocess.asyncio, "to_thread", counting)
    expected = backend.encode(text, add_special_tokens=False).ids
    assert await preprocess._encode(tok, text, add_special_tokens=False) == expected
    assert len(threaded) == 1  # cold: past the BPE budget, finished in the thread
    assert await preprocess._encode(tok, text, add_special_tokens=False) == expected
    assert len(threaded) == 1  # cached: inline
    other = "é" + text
    assert await preprocess._encode(tok, other, add_special_tokens=False) == (
        backend.encode(other, add_special_tokens=False).ids
    )
    assert len(threaded) == 2  # not ASCII: no word cache, the thread
