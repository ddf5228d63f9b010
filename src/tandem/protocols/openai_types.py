"""Response bodies of the OpenAI routes and tandem's utility routes (vLLM's /tokenize and
/detokenize), as msgspec Structs: the source /openapi.json is generated from.

The frontend builds its generate responses as dicts on the hot path
(tandem.frontend.api.completion_format); tests decode real responses into these Structs
(unknown fields forbidden) so the two cannot drift apart.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

MAX_TOKENIZE_IDS = 1_000_000  # /detokenize: at most this many ids per request


class _Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A response body: every field documented (decoding a real body checks that)."""


class ErrorDetail(_Body):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Body):
    error: ErrorDetail


class Model(_Body):
    id: str
    created: int
    owned_by: str
    object: Literal["model"] = "model"


class ModelList(_Body):
    data: list[Model]
    object: Literal["list"] = "list"


class PromptTokensDetails(_Body):
    cached_tokens: int


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ToolCallFunction(_Body):
    name: str
    arguments: str  # JSON text


class ToolCall(_Body):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatTopLogprob(_Body):
    token: str
    logprob: float


class ChatLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(_Body):
    content: list[ChatLogprob]


class ChatChoice(_Body):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(_Body):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(_Body):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(_Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ToolCallFunctionDelta(_Body):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Body):
    """A streamed piece of tool call `index`: the first carries id, type and name."""

    index: int
    function: ToolCallFunctionDelta
    id: str | None = None
    type: Literal["function"] | None = None


class ChatDelta(_Body):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Body):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(_Body):
    """One `data:` event of a streamed chat completion (the last may carry only usage)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(_Body):
    """One `data:` event of a streamed text completion (the last may carry only usage)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize: `prompt` (text) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    # None: True for a prompt, False for messages (the chat template adds them)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(_Body):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Body):
    prompt: str


class Embedding(_Body):
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32
    object: Literal["embedding"] = "embedding"


class EmbeddingUsage(_Body):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Body):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: Literal["list"] = "list"
