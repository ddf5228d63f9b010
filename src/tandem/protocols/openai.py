"""OpenAI-compatible request models (msgspec Structs: fast to decode, unknown fields ignored).

Only shape is checked here; value ranges are checked by `validate_*()` on each request, which
raises InvalidRequest naming the field, the value and the allowed range. Every integer is
bounded to what the engines and the request plane's msgpack (64-bit) carry. Responses are
built as plain dicts by the frontend and encoded with msgspec.json.
"""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

from tandem.errors import InvalidRequest

MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_INT32 = 2**31 - 1  # token counts, top_k and token ids
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # any 64-bit seed, signed or not
MAX_STOP_TOKEN_IDS = 1024  # each banned id costs a mask write per step while min_tokens runs
MAX_STOP_STRINGS = 16

_show = reprlib.Repr()
_show.maxstring, _show.maxother, _show.maxlong, _show.maxlist, _show.maxlevel = 80, 80, 60, 8, 3
_show.maxdict = 8


def show_value(value: Any) -> str:
    """A client's value as error messages quote it: repr, shortened (long strings, lists,
    deep nesting) so that an error never echoes a megabyte back."""
    return _show.repr(value)


MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")  # ASCII digits only ("²".isdigit() is True)
MAX_IDENTIFIER_CHARS = 512  # user, safety_identifier, prompt_cache_key


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    # OpenAI: pad stream deltas with random characters (side-channel hardening); not offered
    include_obfuscation: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int | None = None
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI end-user identifiers: logged with the request id (tandem's equivalent of
    # abuse monitoring); prompt_cache_key: a cache hint, honoured by prefix caching and
    # KV-aware routing, which need no key
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # vLLM extension: salts the prefix cache's block hashes (DESIGN §5): requests with
    # different salts never share KV blocks (not in the router's index, an engine's prefix
    # cache, or the KV tiers); printable text, 1 to MAX_IDENTIFIER_CHARS characters
    cache_salt: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM extension
    # vLLM extension: the priority class (lower = earlier; protocols/tenancy.py), typed Any so
    # that a bad value's 400 lists the classes
    priority: Any = None
    # token id (as a string, JSON object keys are strings) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = None
    # OpenAI fields tandem does not offer: any value other than their `UNSUPPORTED`
    # accepted ones is a 400 naming the field (typed Any so the 400 says why, not "wrong type")
    store: Any = None
    metadata: Any = None
    service_tier: Any = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    # messages stay dicts: the chat template validates them and names the bad field
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    # structured outputs and tool calling (tandem.frontend.pipeline: structured.py, tools.py)
    response_format: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]; checked by `prompt_inputs`
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    response_format: dict[str, Any] | None = None  # as vLLM takes it on completions
    suffix: Any = None


class CompletionIdsRequest(CompletionRequest, kw_only=True):
    """A CompletionRequest whose prompt is one list of token ids, each checked to be an int
    while the JSON is parsed (no Python pass over the ids afterwards; the range is checked on
    their u32 buffer). The frontend tries this type first; a body it rejects is decoded as a
    plain CompletionRequest, whose checks then produce the error (or accept the text / batch
    prompt)."""

    prompt: list[int]


class ParsedTokenIds(Sequence[int]):
    """A prompt's token ids parsed straight from the JSON as ints in [0, 2^32) (the frontend's
    u32 parse, `frontend/prompt_ids.U32TokenIds`): read like the list, taken by the prompt
    checks without a Python pass over them."""

    __slots__ = ()


class Unsupported(NamedTuple):
    """An OpenAI-defined field tandem cannot honour: the values that ask for nothing
    tandem lacks (defaults, "off") and why the others are refused."""

    accepted: tuple[Any, ...]
    why: str


_SHARED_UNSUPPORTED = {
    "store": Unsupported((None, False), "tandem does not store completions"),
    "metadata": Unsupported(
        (None, {}), "metadata attaches to stored completions (store: true), not offered here"
    ),
    "service_tier": Unsupported(
        (None, "auto", "default"), "tandem has one service tier (flex, priority, scale: no)"
    ),
}
UNSUPPORTED_CHAT = {
    **_SHARED_UNSUPPORTED,
    "audio": Unsupported((None,), "audio output is not offered; models here produce text"),
    "modalities": Unsupported((None, ["text"]), "only text output is offered"),
    "prediction": Unsupported((None,), "predicted outputs are not offered"),
    "moderation": Unsupported((None,), "moderation is not offered"),
    "prompt_cache_options": Unsupported(
        (None, {}), "the prefix cache is automatic: no explicit breakpoints or TTLs"
    ),
    "prompt_cache_retention": Unsupported(
        (None, "in_memory"), "cached prefixes live in memory until evicted (no 24h retention)"
    ),
    "reasoning_effort": Unsupported((None,), "the model is not a reasoning model"),
    "verbosity": Unsupported((None,), "the model has no verbosity control"),
    "web_search_options": Unsupported((None,), "web search is not offered"),
}
UNSUPPORTED_COMPLETION = {
    **_SHARED_UNSUPPORTED,
    "suffix": Unsupported((None, ""), "insertion (text after the completion) is not offered"),
}


def check_unsupported(req: msgspec.Struct, table: dict[str, Unsupported]) -> None:
    """Raise InvalidRequest naming the first field whose value asks for something this
    server does not offer."""
    for name, rule in table.items():
        value = getattr(req, name)
        if value is None and None in rule.accepted:
            continue  # unset, as nearly every request leaves them
        if not any(value == ok and type(value) is type(ok) for ok in rule.accepted):
            accepted = " or ".join(
                "unset" if v is None else msgspec.json.encode(v).decode() for v in rule.accepted
            )
            raise InvalidRequest(
                f"{name}={show_value(value)} is not supported by this model/engine: "
                f"{rule.why}; accepted: {accepted}",
                param=name,
            )
    options = getattr(req, "stream_options", None)
    if options is not None and options.include_obfuscation:
        raise InvalidRequest(
            "stream_options.include_obfuscation=true is not supported by this server: stream "
            "deltas are not padded; accepted: false or unset",
            param="stream_options.include_obfuscation",
        )


def _check(ok: bool, param: str, value: Any, expected: str) -> None:
    if not ok:
        raise InvalidRequest(
            f"{param}={show_value(value)} is invalid; expected {expected}", param=param
        )


def _check_int(param: str, value: int, lo: int, hi: int, expected: str = "") -> None:
    _check(lo <= value <= hi, param, value, expected or f"an integer in [{lo}, {hi}]")


def check_cache_salt(salt: str, param: str = "cache_salt") -> None:
    """1 to MAX_IDENTIFIER_CHARS printable characters (a salt the frontend derives for an
    isolated tenant starts with a control character, so no client salt can equal one)."""
    if not 0 < len(salt) <= MAX_IDENTIFIER_CHARS or not salt.isprintable():
        raise InvalidRequest(
            f"{param}={show_value(salt)} is invalid; expected 1 to {MAX_IDENTIFIER_CHARS} "
            "printable characters",
            param=param,
        )


def validate_sampling(req: _SamplingFields) -> None:
    """Range checks shared by chat and completions. Raises InvalidRequest naming the field."""
    _check(bool(req.model), "model", req.model, "a non-empty model name")
    if req.cache_salt is not None:
        check_cache_salt(req.cache_salt)
    _check_int("n", req.n, 1, MAX_N)
    if req.best_of is not None:
        _check_int("best_of", req.best_of, req.n, MAX_N, f"an integer in [n={req.n}, {MAX_N}]")
        streamed = req.stream and req.best_of > req.n
        _check(not streamed, "best_of", req.best_of, f"best_of=n={req.n} when streaming")
    if req.max_tokens is not None:
        _check_int("max_tokens", req.max_tokens, 1, MAX_INT32)
    if req.temperature is not None:
        _check(0.0 <= req.temperature <= 2.0, "temperature", req.temperature, "a number in [0, 2]")
    if req.top_p is not None:
        _check(0.0 < req.top_p <= 1.0, "top_p", req.top_p, "a number in (0, 1]")
    if req.top_k is not None:
        expected = f"-1 or 0 (off) or an integer in [1, {MAX_INT32}]"
        _check_int("top_k", req.top_k, -1, MAX_INT32, expected)
    if req.seed is not None:
        _check_int("seed", req.seed, MIN_SEED, MAX_SEED, "an integer in [-2**63, 2**64 - 1]")
    _check_int("min_tokens", req.min_tokens, 0, MAX_INT32)
    if req.stream_options is not None:  # as OpenAI and vLLM: it would be silently unused
        expected = "unset unless stream is true"
        _check(req.stream, "stream_options", msgspec.to_builtins(req.stream_options), expected)
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None:
            _check(-2.0 <= value <= 2.0, name, value, "a number in [-2, 2]")
    if req.repetition_penalty is not None:
        r = req.repetition_penalty
        _check(0.0 < r < math.inf, "repetition_penalty", r, "a finite number > 0 (1 = off)")
    logit_bias(req)
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        value = getattr(req, name)
        if value is not None:
            expected = f"a string of at most {MAX_IDENTIFIER_CHARS} characters"
            _check(len(value) <= MAX_IDENTIFIER_CHARS, name, value, expected)
    if req.stop_token_ids is not None:
        ids = req.stop_token_ids
        expected = f"at most {MAX_STOP_TOKEN_IDS} token ids"
        _check(len(ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", ids, expected)
        # each id is checked against the model's vocabulary (frontend.preprocess)
    if isinstance(req.stop, list):
        expected = f"at most {MAX_STOP_STRINGS} stop strings"
        _check(len(req.stop) <= MAX_STOP_STRINGS, "stop", req.stop, expected)
    for s in stop_strings(req):
        _check(bool(s), "stop", req.stop, "non-empty stop strings")


def logit_bias(req: _SamplingFields) -> dict[int, float] | None:
    """The request's logit_bias with integer token ids; raises InvalidRequest on a key that
    is not a token id, a bias outside [-100, 100] or more than 300 entries (OpenAI's
    limits). Ids are checked against the vocabulary where the tokenizer is known."""
    if not req.logit_bias:
        return None
    bias = req.logit_bias
    expected = f"at most {MAX_LOGIT_BIAS_ENTRIES} entries"
    _check(len(bias) <= MAX_LOGIT_BIAS_ENTRIES, "logit_bias", bias, expected)
    out: dict[int, float] = {}
    for key, value in bias.items():
        _check(_TOKEN_ID_KEY.fullmatch(key) is not None, "logit_bias", key, "token ids as keys")
        _check(-100.0 <= value <= 100.0, f"logit_bias[{key}]", value, "a number in [-100, 100]")
        out[int(key)] = value
    return out


def num_candidates(req: _SamplingFields) -> int:
    """Completions generated per prompt: best_of (the best n of them are returned) or n."""
    return req.n if req.best_of is None else max(req.best_of, req.n)


def fan_out(req: ChatCompletionRequest | CompletionRequest) -> int:
    """Engine requests this request asks for: prompts × best_of (or n).
    Raises InvalidRequest on a bad n or best_of or a malformed prompt list."""
    _check_int("n", req.n, 1, MAX_N)
    if req.best_of is not None:
        _check_int("best_of", req.best_of, req.n, MAX_N, f"an integer in [n={req.n}, {MAX_N}]")
    if isinstance(req, ChatCompletionRequest):
        return num_candidates(req)
    # one text or one list of token ids (preprocessing checks every id): no pass over the ids
    prompt = req.prompt
    single = isinstance(prompt, str) or (bool(prompt) and type(prompt[0]) is int)
    num_prompts = 1 if single else len(prompt_inputs(prompt))
    return num_prompts * num_candidates(req)


def stop_strings(req: _SamplingFields) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


def validate_chat(req: ChatCompletionRequest) -> None:
    check_unsupported(req, UNSUPPORTED_CHAT)
    validate_sampling(req)
    if req.max_completion_tokens is not None:
        _check_int("max_completion_tokens", req.max_completion_tokens, 1, MAX_INT32)
    if req.top_logprobs is not None:
        _check(
            0 <= req.top_logprobs <= MAX_TOP_LOGPROBS,
            "top_logprobs",
            req.top_logprobs,
            f"an integer in [0, {MAX_TOP_LOGPROBS}]",
        )
        _check(req.logprobs, "logprobs", req.logprobs, "true when top_logprobs is set")


def validate_completion(req: CompletionRequest) -> None:
    check_unsupported(req, UNSUPPORTED_COMPLETION)
    validate_sampling(req)
    if req.echo and req.logprobs is not None:
        raise InvalidRequest(
            "echo=true with logprobs is not supported by this engine: prompt tokens get no "
            "logprobs; accepted: echo without logprobs, or logprobs without echo",
            param="echo",
        )
    if req.logprobs is not None:
        _check(
            0 <= req.logprobs <= MAX_TOP_LOGPROBS,
            "logprobs",
            req.logprobs,
            f"an integer in [0, {MAX_TOP_LOGPROBS}]",
        )


def prompt_inputs(prompt: str | Sequence[Any]) -> list[str | Sequence[int]]:
    """The prompts of a completions request: each a string or a list of token ids (or
    ParsedTokenIds, which read as one)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if isinstance(prompt, ParsedTokenIds):
        return [prompt]
    if set(map(type, prompt)) == {int}:  # one list of ids; checked in C, no per-token frame
        return [prompt]
    out: list[str | Sequence[int]] = []
    for i, item in enumerate(prompt):
        is_ids = (isinstance(item, ParsedTokenIds) and len(item) > 0) or (
            isinstance(item, list) and len(item) > 0 and all(map(_is_token_id, item))
        )
        if isinstance(item, str) or is_ids:
            out.append(item)
        elif isinstance(item, dict) and "type" in item:
            raise InvalidRequest(
                f"prompt[{i}] is a {item['type']!r} content part; /v1/completions takes text "
                "prompts or token ids only; send images to /v1/chat/completions",
                param=f"prompt[{i}]",
            )
        else:
            _check(False, f"prompt[{i}]", item, "a string or a non-empty list of token ids")
    return out


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
