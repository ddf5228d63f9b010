"""tandem's `PreprocessedRequest` → vLLM `SamplingParams` / `TokensPrompt`, and vLLM's
`RequestOutput` deltas → `EngineOutput`. What cannot be mapped is an `InvalidRequest`."""

from __future__ import annotations

from typing import Any

from tandem.errors import InvalidRequest
from tandem.protocols.engine import EngineOutput, FinishReason, PreprocessedRequest, TopLogprob

_FINISH: dict[str, FinishReason] = {
    "stop": "stop", "length": "length", "abort": "cancelled", "repetition": "stop",
}  # fmt: skip


def sampling_params(request: PreprocessedRequest, *, max_logprobs: int) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    if request.lora_name is not None:
        raise InvalidRequest(
            f"lora_name={request.lora_name!r}: the vLLM worker serves no LoRA adapters; "
            "expected none"
        )
    s, stop = request.sampling, request.stop
    if s.logprobs is not None and not 0 <= s.logprobs <= max_logprobs:
        raise InvalidRequest(
            f"top_logprobs={s.logprobs} exceeds this vLLM worker's max_logprobs={max_logprobs}"
        )
    if s.structured is not None:  # until guided decoding is mapped: refused, never dropped
        raise InvalidRequest(
            f"structured output (kind {s.structured.kind!r}) is not mapped for the vLLM worker "
            "yet; send the request without response_format/tool_choice",
            param="response_format",
        )
    stop_ids = list(stop.stop_token_ids)
    if not stop.ignore_eos:  # eos ids the frontend resolved (vLLM also stops on the model's)
        stop_ids += [t for t in request.eos_token_ids if t not in stop_ids]
    return SamplingParams(
        n=1,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k if s.top_k > 0 else 0,
        seed=s.seed,
        max_tokens=stop.max_tokens,
        min_tokens=stop.min_tokens,
        stop_token_ids=stop_ids,
        ignore_eos=stop.ignore_eos,
        logprobs=s.logprobs,
        # tokens a migration carried into the prompt count as prompt here (vLLM's penalties
        # see only what it generated), unlike the native engine (num_generated_tokens)
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        logit_bias=dict(s.logit_bias) if s.logit_bias else None,
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.DELTA,
    )


# vLLM's kv_transfer_params travel in tandem's disagg_params under this key (DESIGN.md §4)
VLLM_PARAMS_KEY = "vllm_kv_transfer_params"
_PREFILL_PARAMS = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}  # fmt: skip


def handoff_args(request: PreprocessedRequest, disagg_mode: str) -> dict[str, Any] | None:
    """SamplingParams.extra_args for vLLM's NixlConnector: a prefill worker keeps the prompt's
    blocks for a remote decode; a decode worker pulls them with the prefill's params."""
    params = request.disagg_params
    if disagg_mode == "prefill":
        return {"kv_transfer_params": dict(_PREFILL_PARAMS)}
    if params is None:
        return None
    if disagg_mode != "decode" or VLLM_PARAMS_KEY not in params:
        raise InvalidRequest(
            f"disagg_params with keys {sorted(params)} cannot be served by this vLLM worker "
            f"(disagg mode {disagg_mode}); expected '{VLLM_PARAMS_KEY}' on a decode worker"
        )
    return {"kv_transfer_params": dict(params[VLLM_PARAMS_KEY])}


def prefill_result(result: EngineOutput, out: Any, request_id: str) -> EngineOutput:
    """A prefill worker's last output: no token (the decode worker generates them all, from
    the KV it pulls: one sampler, so seeded and greedy outputs equal an aggregated run), and
    vLLM's kv_transfer_params for the decode leg."""
    params = getattr(out, "kv_transfer_params", None)
    if not params:
        return EngineOutput(
            finish_reason="error", error=f"vLLM returned no kv_transfer_params for {request_id}"
        )
    return EngineOutput(
        finish_reason="stop",
        num_cached_tokens=result.num_cached_tokens,
        disagg_params={VLLM_PARAMS_KEY: dict(params)},
    )


def tokens_prompt(request: PreprocessedRequest) -> Any:
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(request.token_ids))
    if request.cache_salt is not None:
        prompt["cache_salt"] = request.cache_salt
    return prompt


def engine_output(out: Any, *, first: bool, num_top_logprobs: int | None) -> EngineOutput:
    """One `RequestOutput` (DELTA kind) as an `EngineOutput`; with `num_top_logprobs`, the
    chosen tokens' logprobs and, per token, the top alternatives by rank."""
    completion = out.outputs[0]
    reason = completion.finish_reason
    finish = None if reason is None else _FINISH.get(str(reason), "error")
    result = EngineOutput(
        token_ids=list(completion.token_ids),
        finish_reason=finish,
        num_cached_tokens=(out.num_cached_tokens or 0) if first else None,
        # vLLM's "error" (e.g. a failed KV load) must not read as a normal stop
        error=f"vLLM finished the request with reason {reason!r}" if finish == "error" else None,
    )
    if num_top_logprobs is not None and completion.logprobs is not None:
        chosen: list[float] = []
        tops: list[list[TopLogprob]] = []
        for token, entry in zip(completion.token_ids, completion.logprobs, strict=False):
            chosen.append(float(entry[token].logprob))
            ranked = sorted(
                (lp.rank, tid, lp.logprob)
                for tid, lp in entry.items()
                if lp.rank is not None and lp.rank <= num_top_logprobs
            )
            tops.append([TopLogprob(tid, float(lp)) for _, tid, lp in ranked])
        result.logprobs, result.top_logprobs = chosen, tops
    return result
