"""OpenAI-compatible request models (msgspec Structs: fast to decode, unknown fields ignored).

Only shape is checked here; value ranges are checked by `validate()` on each request, which
raises InvalidRequest naming the field and value. Responses are built as plain dicts by the
frontend and encoded with msgspec.json.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tandem.errors import InvalidRequest

MAX_N = 128
MAX_TOP_LOGPROBS = 20


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int | None = None
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
    user: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    # messages stay dicts: the chat template validates them and names the bad field
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]; checked by `prompt_inputs`
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False


def _check(ok: bool, param: str, value: Any, expected: str) -> None:
    if not ok:
        raise InvalidRequest(f"{param}={value!r} is invalid; expected {expected}", param=param)


def validate_sampling(req: _SamplingFields) -> None:
    """Range checks shared by chat and completions. Raises InvalidRequest naming the field."""
    _check(bool(req.model), "model", req.model, "a non-empty model name")
    _check(1 <= req.n <= MAX_N, "n", req.n, f"an integer in [1, {MAX_N}]")
    if req.max_tokens is not None:
        _check(req.max_tokens >= 1, "max_tokens", req.max_tokens, "an integer >= 1")
    if req.temperature is not None:
        _check(0.0 <= req.temperature <= 2.0, "temperature", req.temperature, "a number in [0, 2]")
    if req.top_p is not None:
        _check(0.0 < req.top_p <= 1.0, "top_p", req.top_p, "a number in (0, 1]")
    if req.top_k is not None:
        _check(req.top_k >= -1, "top_k", req.top_k, "-1 or 0 (off) or a positive integer")
    _check(req.min_tokens >= 0, "min_tokens", req.min_tokens, "an integer >= 0")
    if isinstance(req.stop, list):
        _check(len(req.stop) <= 16, "stop", req.stop, "at most 16 stop strings")
    for s in stop_strings(req):
        _check(bool(s), "stop", req.stop, "non-empty stop strings")


def stop_strings(req: _SamplingFields) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


def validate_chat(req: ChatCompletionRequest) -> None:
    validate_sampling(req)
    if req.max_completion_tokens is not None:
        _check(
            req.max_completion_tokens >= 1,
            "max_completion_tokens",
            req.max_completion_tokens,
            "an integer >= 1",
        )
    if req.top_logprobs is not None:
        _check(
            0 <= req.top_logprobs <= MAX_TOP_LOGPROBS,
            "top_logprobs",
            req.top_logprobs,
            f"an integer in [0, {MAX_TOP_LOGPROBS}]",
        )
        _check(req.logprobs, "logprobs", req.logprobs, "true when top_logprobs is set")


def validate_completion(req: CompletionRequest) -> None:
    validate_sampling(req)
    if req.logprobs is not None:
        _check(
            0 <= req.logprobs <= MAX_TOP_LOGPROBS,
            "logprobs",
            req.logprobs,
            f"an integer in [0, {MAX_TOP_LOGPROBS}]",
        )
    _check(not req.echo, "echo", req.echo, "false (echo is not supported)")


def prompt_inputs(prompt: str | list[Any]) -> list[str | list[int]]:
    """The prompts of a completions request: each a string or a list of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [list(prompt)]
    out: list[str | list[int]] = []
    for i, item in enumerate(prompt):
        is_ids = isinstance(item, list) and item and all(isinstance(t, int) for t in item)
        if isinstance(item, str) or is_ids:
            out.append(item)
        elif isinstance(item, dict) and "type" in item:
            raise InvalidRequest(
                f"prompt[{i}] is a {item['type']!r} content part; /v1/completions takes text "
                "prompts or token ids only; send images to /v1/chat/completions",
                param=f"prompt[{i}]",
            )
        else:
            raise InvalidRequest(
                f"prompt[{i}]={item!r} is invalid; expected a string or a non-empty list of "
                "token ids",
                param=f"prompt[{i}]",
            )
    return out
