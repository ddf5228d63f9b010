from __future__ import annotations

import msgspec
import pytest

from tandem.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound, Overloaded
from tandem.frontend import errors as http_errors
from tandem.frontend.models import ServedModel
from tandem.frontend.preprocess import preprocess_chat, preprocess_completion, resolve_max_tokens
from tandem.protocols.discovery import ModelCard
from tandem.protocols.openai import ChatCompletionRequest, CompletionRequest
from tandem.router.source import StaticInstanceSet
from tandem.tokens.chat_template import ChatTemplate


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
