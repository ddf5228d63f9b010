"""OpenAI request → engine requests: chat template, tokenize, resolve sampling and stop
conditions, check the context length. Pure functions of (request, model); no I/O."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from tandem.errors import ContextLengthExceeded, InvalidRequest
from tandem.frontend.models import ServedModel
from tandem.frontend.pipeline.parsers.reasoning import prompt_opens_think, thinking_disabled
from tandem.frontend.pipeline.parsers.registry import needs_special_tokens
from tandem.frontend.pipeline.prompt_ids import U32TokenIds
from tandem.frontend.pipeline.structured import response_format_output
from tandem.frontend.pipeline.tools import Tool, ToolPlan, plan_tools, render_messages
from tandem.multimodal.loader import ImageLoader
from tandem.multimodal.prompt import (
    expand_placeholders,
    image_parts,
    load_images,
    with_placeholders,
)
from tandem.protocols.engine import (
    MmItem,
    PreprocessedRequest,
    RoutingHints,
    SamplingParams,
    StopConditions,
    StructuredOutput,
    encode,
    token_u32,
)
from tandem.protocols.openai import (
    MAX_INT32,
    ChatCompletionRequest,
    CompletionIdsRequest,
    CompletionRequest,
    logit_bias,
    num_candidates,
    prompt_inputs,
    show_value,
    stop_strings,
    validate_chat,
    validate_completion,
)
from tandem.protocols.tenancy import RequestIdentity
from tandem.tokens.ascii_encoder import OverBudget
from tandem.tokens.tokenizer import ModelTokenizer

# A long prompt (characters) is tokenized off the event loop unless its words are cached:
# the word-cache encoder holds the GIL, so a thread buys fairness only at the interpreter's
# 5 ms switch interval, and its hop cost 0.3-0.5 ms of a cached 3000-token prompt's 0.2 ms
# (more under load: the result waits for the loop). So one up to _INLINE_TOKENIZE_CHARS
# (~2 ms cached) runs inline while at most _INLINE_BPE_WORDS of its words need BPE (~3.5 µs
# each), and goes to the thread from where it stopped (its words done stay cached).
_THREAD_TOKENIZE_CHARS = 16_384
_INLINE_TOKENIZE_CHARS = 1 << 18
_INLINE_BPE_WORDS = 256
SEED_MODULUS = 2**64  # per-choice seeds wrap here: engines take any 64-bit seed


@dataclass(slots=True, kw_only=True)
class Prepared:
    """Everything the handler needs after preprocessing. `requests[i]` serves choice i
    (choices of prompt p are p*n .. p*n+n-1); `prompt_lens[p]` is prompt p's length."""

    request_id: str
    model: ServedModel
    requests: list[PreprocessedRequest]
    prompt_lens: list[int]
    stop_strings: list[str] = field(default_factory=list)
    # best_of: requests[i] are prompt p's candidates p*best_of .. ; the n with the highest
    # mean token logprob are returned (None: every request is a choice)
    best_of: int | None = None
    n: int = 1
    # echo (completions): prompt p's text, put in front of each of its choices
    echo_texts: list[str] | None = None
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    hidden_token_ids: frozenset[int] = frozenset()  # counted, never detokenized
    num_top_logprobs: int | None = None
    # the tool-call format to parse the text with (None: no tools offered) and the offered
    # tools; the reasoning parser (None: off) and whether the prompt leaves the output inside
    # a think block (tandem.frontend.pipeline.parsers)
    tool_parser: str | None = None
    max_tool_calls: int | None = None
    tools: list[Tool] = field(default_factory=list)
    reasoning_parser: str | None = None
    prompt_opens_think: bool = False
    # who asked, at which class (issue 33; None: no tenants and no priority asked)
    identity: RequestIdentity | None = None


async def preprocess_chat(
    req: ChatCompletionRequest,
    model: ServedModel,
    *,
    request_id: str,
    worker_id: str | None,
    deadline_s: float | None,
    images: ImageLoader | None = None,
) -> Prepared:
    validate_chat(req)
    tok = model.require_tokenizer("/v1/chat/completions")
    assert model.chat_template is not None
    messages, prompt_images = req.messages, None
    plain = _plain_text(messages)
    # DESIGN.md §10: one placeholder per image, expanded after tokenizing
    if not plain and (parts := image_parts(messages)):
        assert images is not None, "a chat request with images needs an ImageLoader"
        prompt_images = await load_images(parts, card=model.card, loader=images)
        placeholder = tok.token_text(prompt_images.placeholder_id) or ""
        messages = with_placeholders(messages, placeholder)
    plan, tools = None, None
    if not plain or _has_tool_fields(req):
        plan = plan_tools(
            req.tools, req.tool_choice, req.parallel_tool_calls, req.functions, req.function_call
        )
        messages, tools = render_messages(
            messages,
            plan,
            template_takes_tools=model.chat_template.takes_tools,
            parser=model.tool_call_parser,
        )
    structured = _structured(req.response_format, plan)
    text = model.chat_template.render(
        messages,
        add_generation_prompt=req.add_generation_prompt,
        tools=tools,
        template_kwargs=req.chat_template_kwargs,
    )
    ids = await _encode(tok, text, add_special_tokens=False)
    mm_items: list[MmItem] = []
    if prompt_images is not None:
        ids, mm_items = expand_placeholders(ids, prompt_images)
    max_tokens = req.max_completion_tokens or req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    top = (req.top_logprobs or 0) if req.logprobs else None
    base = _base_request(req, model, request_id, worker_id, deadline_s, top)
    base.mm_items = mm_items
    base.sampling = msgspec.structs.replace(base.sampling, structured=structured)
    requests = _fan_out(base, [ids], model, num_candidates(req), max_tokens, param, "messages")
    tool_parser = plan.parser(model.tool_call_parser) if plan is not None else None
    keep_special = bool(
        req.skip_special_tokens and tool_parser is not None and needs_special_tokens(tool_parser)
    )
    reasoning = model.reasoning_parser
    # a grammar (response_format, a forced call) holds the output from its first token: no
    # think block in it, and a parser that starts inside one would take the answer for one
    if reasoning is not None and (
        structured is not None or thinking_disabled(req.chat_template_kwargs)
    ):
        reasoning = None
    return Prepared(
        request_id=request_id,
        model=model,
        requests=requests,
        prompt_lens=[len(ids)],
        stop_strings=stop_strings(req),
        include_stop_str=req.include_stop_str_in_output,
        # a format opened by a special token ([TOOL_CALLS]) needs it in the text, not the EOS
        skip_special_tokens=req.skip_special_tokens and not keep_special,
        hidden_token_ids=frozenset(model.eos_token_ids) if keep_special else frozenset(),
        num_top_logprobs=top,
        tool_parser=tool_parser,
        max_tool_calls=plan.max_calls if plan is not None else None,
        tools=plan.tools if plan is not None else [],
        reasoning_parser=reasoning,
        prompt_opens_think=reasoning is not None and prompt_opens_think(text),
        best_of=_best_of(req),
        n=req.n,
    )


def _plain_text(messages: list[dict[str, Any]]) -> bool:
    """Whether every message is plain text (no content parts, no tool calls or results): the
    chat template alone renders them, with no image or tool step."""
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("content"), str | None):
            return False
        if message.get("role") == "tool" or message.get("tool_calls") is not None:
            return False
    return True


def _has_tool_fields(req: ChatCompletionRequest) -> bool:
    return not (
        req.tools is None
        and req.tool_choice is None
        and req.parallel_tool_calls is None
        and req.functions is None
        and req.function_call is None
    )


async def preprocess_completion(
    req: CompletionRequest,
    model: ServedModel,
    *,
    request_id: str,
    worker_id: str | None,
    deadline_s: float | None,
) -> Prepared:
    validate_completion(req)
    prompts: list[Sequence[int]] = []
    u32: dict[int, bytes] = {}
    if isinstance(req, CompletionIdsRequest) and req.prompt:  # ints, checked while parsed
        vocab = model.tokenizer.vocab_size if model.tokenizer is not None else None
        if isinstance(req.prompt, U32TokenIds):  # parsed straight into u32s
            check_u32_prompt(req.prompt, vocab, 0)
            u32[0] = req.prompt.u32_le
        elif (token_bytes := prompt_id_bytes(req.prompt, vocab)) is not None:
            u32[0] = token_bytes
        prompts.append(req.prompt)
    for i, prompt in enumerate(prompt_inputs(req.prompt) if not prompts else ()):
        if isinstance(prompt, str):
            tok = model.require_tokenizer("a text prompt")
            ids = await _encode(tok, prompt, add_special_tokens=True)
            if not ids:  # an engine needs at least one prompt token
                param = f"prompt[{i}]" if isinstance(req.prompt, list) else "prompt"
                raise InvalidRequest(
                    f"{param}={show_value(prompt)} has no tokens; expected a non-empty prompt",
                    param=param,
                )
            prompts.append(ids)
        elif isinstance(prompt, U32TokenIds):  # one of a batch parsed straight into u32s
            check_u32_prompt(prompt, vocab_of(model), i)
            u32[i] = prompt.u32_le
            prompts.append(prompt)
        else:
            _check_ids(model, prompt, i)
            prompts.append(prompt)
    base = _base_request(req, model, request_id, worker_id, deadline_s, req.logprobs)
    if req.response_format is not None:  # a plain request skips structured outputs
        structured = response_format_output(req.response_format)
        base.sampling = msgspec.structs.replace(base.sampling, structured=structured)
    num = num_candidates(req)
    requests = _fan_out(base, prompts, model, num, req.max_tokens, "max_tokens", "prompt", u32)
    return Prepared(
        request_id=request_id,
        model=model,
        requests=requests,
        prompt_lens=[len(p) for p in prompts],
        stop_strings=stop_strings(req),
        include_stop_str=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        num_top_logprobs=req.logprobs,
        best_of=_best_of(req),
        n=req.n,
        echo_texts=_echo_texts(model, prompt_inputs(req.prompt)) if req.echo else None,
    )


def _structured(response_format: Any, plan: ToolPlan | None) -> StructuredOutput | None:
    """The request's one constraint: response_format's or a forced tool call's."""
    structured = None if response_format is None else response_format_output(response_format)
    if plan is None or plan.structured is None:
        return structured
    if structured is not None:
        raise InvalidRequest(
            "response_format json cannot be combined with a forced tool call (tool_choice "
            "'required' or a named function); drop one of them",
            param="response_format",
        )
    return plan.structured


async def _encode(tok: ModelTokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
    if len(text) <= _THREAD_TOKENIZE_CHARS:
        return tok.encode(text, add_special_tokens=add_special_tokens)
    if len(text) <= _INLINE_TOKENIZE_CHARS:
        with contextlib.suppress(OverBudget):
            return tok.encode(
                text, add_special_tokens=add_special_tokens, miss_budget=_INLINE_BPE_WORDS
            )
    return await asyncio.to_thread(tok.encode, text, add_special_tokens=add_special_tokens)


def prompt_id_bytes(ids: list[int], vocab: int | None) -> bytes | None:
    """`ids` (ints) as the LE u32 bytes the request plane ships; raises InvalidRequest naming
    the first id < 0 or >= `vocab`. None: an id >= 2^32 and no vocabulary known (the ids then
    travel as a list)."""
    try:
        data = array("I", ids)  # one C pass; refuses what is not a u32
    except OverflowError:
        check_prompt_ids(ids, vocab, 0)  # names the first offender
        return None
    if vocab is not None and data and int(np.frombuffer(data, dtype=np.uint32).max()) >= vocab:
        check_prompt_ids(ids, vocab, 0)
    if sys.byteorder != "little":
        data.byteswap()
    return data.tobytes()


def check_u32_prompt(ids: U32TokenIds, vocab: int | None, index: int) -> None:
    """check_prompt_ids for ids already in u32s (none negative): the first id >= vocab."""
    if vocab is not None and ids.max_id >= vocab:
        first = int(np.argmax(np.frombuffer(ids.ids, dtype=np.uint32) >= vocab))
        raise _out_of_range(ids[first], vocab, index)


def vocab_of(model: ServedModel) -> int | None:
    return model.tokenizer.vocab_size if model.tokenizer is not None else None


def _check_ids(model: ServedModel, ids: Sequence[int], index: int) -> None:
    check_prompt_ids(ids, vocab_of(model), index)


def check_prompt_ids(ids: Sequence[int], vocab: int | None, index: int) -> None:
    """Raise InvalidRequest naming the first id outside [0, vocab). (One Python pass: measured
    no slower than min() + max() in C, which walk the list twice.)"""
    for t in ids:
        if t < 0 or (vocab is not None and t >= vocab):
            raise _out_of_range(t, vocab, index)


def _out_of_range(t: int, vocab: int | None, index: int) -> InvalidRequest:
    return InvalidRequest(
        f"prompt token id {t} out of range; expected [0, {vocab or 'vocab size'})",
        param=f"prompt[{index}]" if index else "prompt",
    )


MAX_IDS_SHOWN = 8  # of the offending ids an error names


def _check_stop_ids(model: ServedModel, ids: list[int]) -> None:
    """Raise InvalidRequest naming every stop token id outside [0, vocab_size) (the first
    few of them), and the range; without a tokenizer, outside the int32 ids workers take."""
    vocab = vocab_of(model)
    end = vocab if vocab is not None else MAX_INT32 + 1
    bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < end]
    if not bad:
        return
    named = ", ".join(f"stop_token_ids[{i}]={show_value(t)}" for i, t in bad[:MAX_IDS_SHOWN])
    if len(bad) > MAX_IDS_SHOWN:
        named += f" and {len(bad) - MAX_IDS_SHOWN} more"
    where = (
        f"[0, {vocab}) (the model's vocab_size is {vocab})" if vocab is not None else f"[0, {end})"
    )
    raise InvalidRequest(
        f"{named} {'is not a token id' if len(bad) == 1 else 'are not token ids'} of this "
        f"model; expected ids in {where}",
        param=f"stop_token_ids[{bad[0][0]}]",
    )


def _echo_texts(model: ServedModel, prompts: list[str | Sequence[int]]) -> list[str]:
    """Each prompt as text (token-id prompts decoded, special tokens kept, as vLLM echoes)."""
    if all(isinstance(p, str) for p in prompts):
        return [p for p in prompts if isinstance(p, str)]
    tok = model.require_tokenizer("echo of a token-id prompt")
    return [
        p if isinstance(p, str) else tok.decode(list(p), skip_special_tokens=False) for p in prompts
    ]


def _best_of(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    return req.best_of if req.best_of is not None and req.best_of > req.n else None


def _check_logit_bias(model: ServedModel, bias: dict[int, float] | None) -> None:
    vocab = model.tokenizer.vocab_size if model.tokenizer is not None else None
    for t in bias or {}:
        if vocab is not None and t >= vocab:
            raise InvalidRequest(
                f"logit_bias token id {t} is out of range; expected a token id in [0, {vocab})",
                param="logit_bias",
            )


def _base_request(req, model, request_id, worker_id, deadline_s, top) -> PreprocessedRequest:  # type: ignore[no-untyped-def]
    _check_stop_ids(model, req.stop_token_ids or [])
    bias = logit_bias(req)
    _check_logit_bias(model, bias)
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    if _best_of(req) is not None and top is None:
        top = 0  # ranking the candidates needs each token's logprob
    sampling = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        seed=req.seed,
        logprobs=top,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=bias,
    )
    stop = StopConditions(
        max_tokens=1,
        stop_token_ids=list(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
    )
    base = PreprocessedRequest(
        request_id=request_id,
        model=model.card.name,  # the base model (an adapter's requests go to its workers)
        lora_name=model.lora_name,
        token_ids=[],
        sampling=sampling,
        stop=stop,
        eos_token_ids=model.eos_token_ids,
        routing=RoutingHints(worker_id=worker_id) if worker_id else None,
        deadline_s=deadline_s,
        cache_salt=req.cache_salt,
    )
    try:  # fail here, before a router counts it in flight, should a field escape validation
        encode(base)
    except (OverflowError, TypeError, ValueError) as exc:
        raise InvalidRequest(f"request cannot be sent to a worker: {exc}") from exc
    return base


def resolve_max_tokens(
    prompt_len: int, context_length: int, requested: int | None, param: str, prompt_param: str
) -> int:
    """Tokens left to generate; raises ContextLengthExceeded with the numbers."""
    if prompt_len >= context_length:
        raise ContextLengthExceeded(
            f"prompt has {prompt_len} tokens; model context is {context_length}",
            param=prompt_param,
        )
    remaining = context_length - prompt_len
    if requested is None:
        return remaining
    if requested > remaining:
        raise ContextLengthExceeded(
            f"{param}={requested} exceeds remaining context {remaining} "
            f"(model limit {context_length} − prompt {prompt_len})",
            param=param,
        )
    return requested


def _fan_out(
    base: PreprocessedRequest,
    prompts: list[Sequence[int]],
    model: ServedModel,
    n: int,
    max_tokens: int | None,
    param: str,
    prompt_param: str,
    u32: dict[int, bytes] | None = None,
) -> list[PreprocessedRequest]:
    """One request per prompt × choice; each carries its prompt's u32 bytes (`u32[p]` when the
    caller made them already), so routing and the request plane convert the ids once."""
    out: list[PreprocessedRequest] = []
    multi = len(prompts) * n > 1
    for p, ids in enumerate(prompts):
        token_bytes = (u32 or {}).get(p) or token_u32(ids)
        limit = resolve_max_tokens(
            len(ids), model.card.context_length, max_tokens, param, prompt_param
        )
        if base.stop.min_tokens > limit:
            what = f"{param}={limit}" if max_tokens else f"the {limit} tokens of context left"
            raise InvalidRequest(
                f"min_tokens={base.stop.min_tokens} exceeds {what}; lower min_tokens",
                param="min_tokens",
            )
        stop = msgspec.structs.replace(base.stop, max_tokens=limit)
        for i in range(n):
            sampling = base.sampling
            if base.sampling.seed is not None and i:  # choice i: seed + i, wrapped to 64 bits
                seed = (base.sampling.seed + i) % SEED_MODULUS
                sampling = msgspec.structs.replace(sampling, seed=seed)
            rid = f"{base.request_id}-{p * n + i}" if multi else base.request_id
            out.append(
                msgspec.structs.replace(
                    base,
                    request_id=rid,
                    token_ids=ids,
                    token_bytes=token_bytes,
                    stop=stop,
                    sampling=sampling,
                )
            )
    return out
