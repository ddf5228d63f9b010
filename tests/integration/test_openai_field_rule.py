"""The request-field rule, field by field, with the official `openai` SDK against a real
frontend and the real SmolLM2 native engine: every field OpenAI defines for
/v1/chat/completions and /v1/completions either has its documented effect (observed here)
or gets a 400 naming the field.

The field lists are the request bodies of "Create chat completion" and "Create completion"
in the OpenAI API reference (platform.openai.com/docs/api-reference/chat/create and
/completions/create). The official `openai` SDK is generated from OpenAI's OpenAPI spec of
that reference, so its `CompletionCreateParamsStreaming` TypedDicts carry the same names;
`test_the_lists_match_the_sdk` checks the lists against the installed SDK, so a field a newer
SDK adds fails here until it is given a rule.

/v1/rerank and /v1/score follow the same rule over the fields of vLLM's rerank and score
requests (checked against .venv-vllm's vLLM where it is built) and Jina's and Cohere's rerank
fields.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import logging
import typing
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import cohere
import msgspec
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from tests.support.frontend_stack import CHAT, FrontendStack
from tests.support.smollm2 import smollm2_gguf

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.native.config import NativeConfig
from tandem.engines.native.engine import NativeEngine
from tandem.protocols.rerank import RerankRequest, ScoreRequest
from tandem.tokens.tokenizer import ModelTokenizer, load_tokenizer

pytestmark = [pytest.mark.native, pytest.mark.timeout(240)]
MODEL = "smollm2"
MESSAGES = [{"role": "user", "content": "Write the word cat twenty times."}]
PROMPT = "Write the word cat twenty times: cat cat cat cat"

CHAT_FIELDS = (
    "messages", "model", "audio", "moderation", "prompt_cache_options", "prompt_cache_retention",
    "frequency_penalty", "function_call", "functions",
    "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities",
    "n", "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key",
    "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop",
    "store", "stream", "stream_options", "temperature", "tool_choice", "tools", "top_logprobs",
    "top_p", "user", "verbosity", "web_search_options",
)  # fmt: skip
COMPLETION_FIELDS = (
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
    "temperature", "top_p", "user",
)  # fmt: skip
# field -> a value OpenAI defines that tandem does not offer (each must be a 400 naming it)
CHAT_REFUSED = {
    "audio": {"voice": "alloy", "format": "wav"},
    "metadata": {"project": "x"},
    "modalities": ["text", "audio"],
    "moderation": {"model": "omni-moderation-latest"},
    "prompt_cache_options": {"mode": "explicit"},
    "prompt_cache_retention": "24h",
    "prediction": {"type": "content", "content": "the cat"},
    "reasoning_effort": "high",
    "service_tier": "flex",
    "store": True,
    "verbosity": "low",
    "web_search_options": {},
}
COMPLETION_REFUSED = {
    "suffix": " and then",
}

Client = openai.AsyncOpenAI
Check = Callable[[Client, dict[str, Any]], Awaitable[None]]


@functools.cache
def _tokenizer() -> ModelTokenizer:
    return load_tokenizer(f"gguf:{smollm2_gguf()}")


def test_the_lists_match_the_sdk() -> None:
    chat = set(typing.get_type_hints(chat_create_params.CompletionCreateParamsStreaming))
    legacy = set(typing.get_type_hints(completion_create_params.CompletionCreateParamsStreaming))
    assert chat == set(CHAT_FIELDS)
    assert legacy == set(COMPLETION_FIELDS)


async def _chat(client: Client, **kw: Any) -> Any:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, **kw}
    extra = {"ignore_eos": True}
    return await client.chat.completions.create(**body, extra_body=extra)


async def _text(client: Client, **kw: Any) -> Any:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **kw}
    return await client.completions.create(**body, extra_body={"ignore_eos": True})


def _content(resp: Any) -> str:
    return resp.choices[0].message.content


async def _refused(call: Awaitable[Any], field: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await call
    error = info.value.body
    assert isinstance(error, dict) and error.get("param") == field, error
    assert "not supported" in error["message"] and "accepted" in error["message"], error


async def _chat_effects(client: Client, caplog: pytest.LogCaptureFixture) -> set[str]:
    """Each accepted chat field's documented effect; returns the fields checked."""
    base = await _chat(client)
    greedy = _content(base)
    assert base.model == MODEL and greedy  # model, messages
    first_token = _tokenizer().encode(greedy)[0]
    biased = await _chat(client, logit_bias={str(first_token): -100})
    assert not _content(biased).startswith(greedy[:4]), (greedy, _content(biased))
    for field in ("frequency_penalty", "presence_penalty"):
        assert _content(await _chat(client, **{field: 2.0})) != greedy, field
    lp = await _chat(client, logprobs=True, top_logprobs=3)
    assert len(lp.choices[0].logprobs.content) == 12  # logprobs
    assert all(len(e.top_logprobs) == 3 for e in lp.choices[0].logprobs.content)
    for field in ("max_completion_tokens", "max_tokens"):
        assert (await _chat(client, **{field: 3})).usage.completion_tokens == 3, field
    assert len((await _chat(client, n=2)).choices) == 2
    hot = {"temperature": 1.8, "seed": 11}
    sampled = _content(await _chat(client, **hot))
    assert sampled != greedy  # temperature
    assert _content(await _chat(client, **hot)) == sampled  # seed
    assert _content(await _chat(client, **hot, top_p=1e-6)) == greedy  # top_p keeps the top
    word = greedy.split()[1]
    cut = await _chat(client, stop=[word])
    assert cut.choices[0].finish_reason == "stop" and word not in _content(cut)
    stream = await _chat(client, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == greedy
    assert chunks[-1].usage.completion_tokens == 12  # stream, stream_options
    key = {"prompt_cache_key": "cat-prompts"}
    await _chat(client, **key)
    cached = (await _chat(client, **key)).usage.prompt_tokens_details.cached_tokens
    assert cached > 0  # prompt_cache_key: the prompt's blocks are reused
    with caplog.at_level(logging.DEBUG, logger="tandem.frontend.api.chat"):
        await _chat(client, user="alice-1", safety_identifier="hash-42")
    assert "user=alice-1" in caplog.text and "safety_identifier=hash-42" in caplog.text
    accepted = {"store": False, "service_tier": "auto", "modalities": ["text"]}
    await _chat(client, **accepted, prompt_cache_retention="in_memory")
    return {
        "model", "messages", "logit_bias", "frequency_penalty", "presence_penalty", "logprobs",
        "top_logprobs", "max_completion_tokens", "max_tokens", "n", "temperature", "seed",
        "top_p", "stop", "stream", "stream_options", "prompt_cache_key", "user",
        "safety_identifier",
    }  # fmt: skip


TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


async def _tool_effects(client: Client) -> set[str]:
    """Structured outputs and tool calls, in brief (tests/e2e/test_serve_structured.py has
    them in depth)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "num", "schema": schema}}
    out = _content(await _chat(client, response_format=fmt, max_tokens=24))
    assert isinstance(json.loads(out)["n"], int), out  # response_format
    forced = {"tools": [TOOL], "parallel_tool_calls": False, "max_tokens": 48}
    named = {"type": "function", "function": {"name": "get_time"}}
    resp = await _chat(client, **forced, tool_choice=named)
    calls = resp.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1 and calls[0].function.name == "get_time"
    assert "city" in json.loads(calls[0].function.arguments)  # tools, tool_choice, parallel
    for legacy in ("functions", "function_call"):
        value = [TOOL["function"]] if legacy == "functions" else "auto"
        with pytest.raises(openai.BadRequestError) as info:
            await _chat(client, **{legacy: value})
        assert isinstance(info.value.body, dict) and info.value.body["param"] == legacy
        assert "not supported" in info.value.body["message"]
    return {
        "response_format", "tools", "tool_choice", "parallel_tool_calls", "functions",
        "function_call",
    }  # fmt: skip


async def _completion_effects(client: Client, caplog: pytest.LogCaptureFixture) -> set[str]:
    base = await _text(client)
    greedy = base.choices[0].text
    assert base.model == MODEL and greedy
    first_token = _tokenizer().encode(greedy)[0]
    biased = await _text(client, logit_bias={str(first_token): -100})
    assert not biased.choices[0].text.startswith(greedy[:4])
    for field in ("frequency_penalty", "presence_penalty"):
        assert (await _text(client, **{field: 2.0})).choices[0].text != greedy, field
    lp = await _text(client, logprobs=2)
    assert len(lp.choices[0].logprobs.token_logprobs) == 12
    assert all(len(t) == 2 for t in lp.choices[0].logprobs.top_logprobs)
    assert (await _text(client, max_tokens=3)).usage.completion_tokens == 3
    assert len((await _text(client, n=2)).choices) == 2
    hot = {"temperature": 1.8, "seed": 11}
    sampled = (await _text(client, **hot)).choices[0].text
    assert sampled != greedy and (await _text(client, **hot)).choices[0].text == sampled
    assert (await _text(client, **hot, top_p=1e-6)).choices[0].text == greedy
    # best_of: candidate i is seeded seed+i; the answer is the one with the best mean logprob
    candidates = [await _text(client, **{**hot, "seed": 11 + i}, logprobs=0) for i in range(3)]
    means = [sum(c.choices[0].logprobs.token_logprobs) / 12 for c in candidates]
    best = candidates[means.index(max(means))].choices[0].text
    picked = await _text(client, **hot, best_of=3)
    assert picked.choices[0].text == best and picked.choices[0].logprobs is None
    assert picked.usage.completion_tokens == 36  # every candidate counts
    word = greedy.split()[1]
    cut = await _text(client, stop=word)
    assert cut.choices[0].finish_reason == "stop" and word not in cut.choices[0].text
    stream = await _text(client, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == greedy
    assert chunks[-1].usage.completion_tokens == 12
    echoed = await _text(client, echo=True)
    assert echoed.choices[0].text == PROMPT + greedy  # echo
    await _refused(_text(client, echo=True, logprobs=1), "echo")  # no prompt logprobs
    with caplog.at_level(logging.DEBUG, logger="tandem.frontend.api.chat"):
        await _text(client, user="bob-2")
    assert "user=bob-2" in caplog.text
    return {
        "model", "prompt", "logit_bias", "frequency_penalty", "presence_penalty", "logprobs",
        "max_tokens", "n", "temperature", "seed", "top_p", "best_of", "stop", "stream",
        "stream_options", "user", "echo",
    }  # fmt: skip


async def test_every_openai_field_has_its_effect_or_a_400_naming_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        config = NativeConfig(num_blocks=256, max_num_batched_tokens=256, num_threads=1)
        await s.add_worker(NativeEngine(config))
        ready = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}
        await s.start_frontend(ready, ready_path=CHAT)
        client = openai.AsyncOpenAI(base_url=f"{s.base}/v1", api_key="x", max_retries=0)
        for field, value in CHAT_REFUSED.items():
            await _refused(_chat(client, **{field: value}), field)
        for field, value in COMPLETION_REFUSED.items():
            await _refused(_text(client, **{field: value}), field)
        chat_done = await _chat_effects(client, caplog) | set(CHAT_REFUSED)
        text_done = await _completion_effects(client, caplog) | set(COMPLETION_REFUSED)
        chat_done |= await _tool_effects(client)
        assert set(CHAT_FIELDS) - chat_done == set()
        assert set(COMPLETION_FIELDS) - text_done == set()


# /v1/rerank and /v1/score: the fields of vLLM's RerankRequest and Score*Request (vLLM 0.32:
# entrypoints/pooling/scoring/protocol.py and pooling/base/protocol.py), Jina's and Cohere's
# rerank fields, and the activation switches older vLLM took before use_activation
VLLM_SCORING = (
    "model", "user", "truncate_prompt_tokens", "padding", "truncation_side", "request_id",
    "priority", "mm_processor_kwargs", "cache_salt", "use_activation", "max_tokens_per_query",
    "max_tokens_per_doc", "instruction", "chat_template_kwargs",
)  # fmt: skip
VLLM_RERANK = (*VLLM_SCORING, "query", "documents", "top_n")
VLLM_SCORE_PAIRS = ("text_1", "text_2", "data_1", "data_2", "queries", "documents", "items")
RERANK_FIELDS = (*VLLM_RERANK, "return_documents", "rank_fields", "max_chunks_per_doc",
                 "relevant_spans", "softmax", "activation")  # fmt: skip
SCORE_FIELDS = (*VLLM_SCORING, *VLLM_SCORE_PAIRS, "softmax", "activation")
SCORING_REFUSED = {
    "priority": 3,
    "use_activation": True,
    "softmax": True,
    "activation": True,
    "mm_processor_kwargs": {"size": 4},
    "instruction": "Judge relevance",
    "chat_template_kwargs": {"instruction": "x"},
    "padding": "max_length",
}
RERANK_REFUSED = {
    **SCORING_REFUSED,
    "rank_fields": ["title"],
    "max_chunks_per_doc": 2,
    "relevant_spans": {"mode": "enabled"},
}
QUERY, DOCS = "Where did the cat sit?", ["The cat sat on the mat.", "Markets fell.", "A dog ran."]


def test_the_rerank_and_score_lists_match_the_request_models() -> None:
    assert {f.name for f in msgspec.structs.fields(RerankRequest)} == set(RERANK_FIELDS)
    assert {f.name for f in msgspec.structs.fields(ScoreRequest)} == set(SCORE_FIELDS)


def test_the_rerank_list_holds_every_field_the_cohere_sdk_sends() -> None:
    """Cohere's v1 and v2 clients (the rerank clients vLLM's rerank answers) are generated
    from Cohere's API definition, as openai's from OpenAI's."""
    for method in (cohere.AsyncClient.rerank, cohere.AsyncClientV2.rerank):
        params = set(inspect.signature(method).parameters) - {"self", "request_options"}
        assert params - set(RERANK_FIELDS) == set(), method


def test_the_rerank_and_score_lists_match_the_installed_vllm() -> None:
    """Read from .venv-vllm's source (importing vLLM takes a minute): a field a newer vLLM
    adds fails here until it is given a rule."""
    venv = Path(__file__).resolve().parents[2] / ".venv-vllm"
    found = sorted(venv.glob("lib/python3*/site-packages/vllm/entrypoints/pooling"))
    if not found:
        pytest.skip(".venv-vllm is not built")
    fields = _pydantic_fields(found[0] / "base/protocol.py", found[0] / "scoring/protocol.py")
    assert fields("RerankRequest") == set(VLLM_RERANK)
    for name, pair in [
        ("ScoreTextRequest", ("text_1", "text_2")),
        ("ScoreDataRequest", ("data_1", "data_2")),
        ("ScoreQueriesDocumentsRequest", ("queries", "documents")),
        ("ScoreQueriesItemsRequest", ("queries", "items")),
    ]:
        assert fields(name) == {*VLLM_SCORING, *pair}, name


def _pydantic_fields(*files: Path) -> Callable[[str], set[str]]:
    """Annotated class attributes of the classes in `files`, bases (found there) included."""
    classes: dict[str, tuple[list[str], set[str]]] = {}
    for file in files:
        for node in ast.parse(file.read_text()).body:
            if isinstance(node, ast.ClassDef):
                bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
                own = {
                    item.target.id
                    for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                }
                classes[node.name] = (bases, own)

    def fields(name: str) -> set[str]:
        bases, own = classes.get(name, ([], set()))
        return own.union(*(fields(b) for b in bases))

    return fields


async def test_every_rerank_and_score_field_has_its_effect_or_a_400_naming_it() -> None:
    """On a mocker worker: every effect here is the frontend's (which texts, cut where, which
    results, which id), the same whatever engine embeds; the native engine's scores are
    tests/integration/test_frontend_rerank_native.py's."""
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        await s.add_worker(MockerEngine(MockerConfig(speedup_ratio=0)))
        ready = {"model": MODEL, "query": "q", "documents": ["d"]}
        await s.start_frontend(ready, ready_path="/v1/rerank")
        rerank_done = await _rerank_effects(s)
        score_done = await _score_effects(s)
        for path, refused in (("/v1/rerank", RERANK_REFUSED), ("/v1/score", SCORING_REFUSED)):
            base = (
                {"model": MODEL, "query": QUERY, "documents": DOCS}
                if path == "/v1/rerank"
                else {"model": MODEL, "text_1": QUERY, "text_2": DOCS}
            )
            for field, value in refused.items():
                status, error = await _post(s, path, {**base, field: value})
                assert status == 400 and error["param"] == field, (path, error)
                assert "not supported" in error["message"] and "accepted" in error["message"]
        assert set(RERANK_FIELDS) - rerank_done - set(RERANK_REFUSED) == set()
        assert set(SCORE_FIELDS) - score_done - set(SCORING_REFUSED) == set()


async def _post(s: FrontendStack, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    assert s.http is not None
    async with s.http.post(f"{s.base}{path}", data=json.dumps(body)) as resp:
        out = await resp.json()
        return resp.status, out.get("error", out)


async def _rerank_effects(s: FrontendStack) -> set[str]:
    body = {"model": MODEL, "query": QUERY, "documents": DOCS}
    lengths = [len(_tokenizer().encode(t)) for t in (QUERY, *DOCS)]
    assert min(lengths) > 2

    async def rerank(**kw: Any) -> Any:
        status, out = await _post(s, "/v1/rerank", {**body, **kw})
        assert status == 200, out
        return out

    base = await rerank()
    assert base["model"] == MODEL and len(base["results"]) == 3  # model, query, documents
    assert base["usage"]["prompt_tokens"] == sum(lengths)
    scores = [r["relevance_score"] for r in base["results"]]
    assert scores == sorted(scores, reverse=True)
    assert (await rerank(top_n=1))["results"] == base["results"][:1]
    assert all("document" not in r for r in (await rerank(return_documents=False))["results"])
    assert (await rerank(max_tokens_per_doc=1))["usage"]["prompt_tokens"] == lengths[0] + 3
    got = (await rerank(max_tokens_per_query=1))["usage"]["prompt_tokens"]
    assert got == 1 + sum(lengths[1:])
    left = await rerank(truncate_prompt_tokens=2)
    assert left["usage"]["prompt_tokens"] == 2 * 4  # every text keeps 2 tokens
    right = await rerank(truncate_prompt_tokens=2, truncation_side="right")
    assert left["results"] != right["results"]  # truncation_side: other tokens kept
    assert (await rerank(request_id="abc-1"))["id"] == "rerank-abc-1"
    # accepted: tandem keeps no per-user state, and an embedding never reads or fills the
    # prefix cache that cache_salt salts
    assert (await rerank(user="u-1", cache_salt="salt"))["results"] == base["results"]
    return {
        "model", "query", "documents", "top_n", "return_documents", "max_tokens_per_doc",
        "max_tokens_per_query", "truncate_prompt_tokens", "truncation_side", "request_id",
        "user", "cache_salt",
    }  # fmt: skip


async def _score_effects(s: FrontendStack) -> set[str]:
    async def score(**kw: Any) -> Any:
        status, out = await _post(s, "/v1/score", {"model": MODEL, **kw})
        assert status == 200, out
        return out

    base = await score(text_1=QUERY, text_2=DOCS)
    assert base["model"] == MODEL and len(base["data"]) == 3
    for first, second in (("data_1", "data_2"), ("queries", "documents"), ("queries", "items")):
        assert (await score(**{first: QUERY, second: DOCS}))["data"] == base["data"], first
    pairs = {"text_1": QUERY, "text_2": DOCS}
    cut = await score(**pairs, max_tokens_per_doc=1, max_tokens_per_query=1)
    assert cut["usage"]["prompt_tokens"] == 1 + 3
    kept = await score(**pairs, truncate_prompt_tokens=1, truncation_side="right")
    assert kept["usage"]["prompt_tokens"] == 4 and kept["data"] == cut["data"]
    assert (await score(**pairs, request_id="s-1"))["id"] == "score-s-1"
    assert (await score(**pairs, user="u", cache_salt="x"))["data"] == base["data"]
    return {
        "model", *VLLM_SCORE_PAIRS, "max_tokens_per_doc", "max_tokens_per_query",
        "truncate_prompt_tokens", "truncation_side", "request_id", "user", "cache_salt",
    }  # fmt: skip
