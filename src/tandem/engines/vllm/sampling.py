"""tandem's `PreprocessedRequest` → vLLM `SamplingParams` / `TokensPrompt`, and vLLM's
`RequestOutput` deltas → `EngineOutput`. What cannot be mapped is an `InvalidRequest`."""

from __future__ import annotations

import json
from typing import Any

from tandem.errors import InvalidRequest
from tandem.protocols.engine import (
    EngineOutput,
    FinishReason,
    PreprocessedRequest,
    StructuredOutput,
    TopLogprob,
)

_FINISH: dict[str, FinishReason] = {
    "stop": "stop", "length": "length", "abort": "cancelled", "repetition": "stop",
}  # fmt: skip


def sampling_params(
    request: PreprocessedRequest, *, max_logprobs: int, constrain: bool = True
) -> Any:
    """vLLM's SamplingParams for the request; `constrain=False` leaves out its structured
    output (a prefill worker's one token is thrown away: no grammar to compile for it)."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import RequestOutputKind

    s, stop = request.sampling, request.stop
    if s.logprobs is not None and not 0 <= s.logprobs <= max_logprobs:
        raise InvalidRequest(
            f"top_logprobs={s.logprobs} exceeds this vLLM worker's max_logprobs={max_logprobs}"
        )
    stop_ids = list(stop.stop_token_ids)
    if not stop.ignore_eos:  # eos ids the frontend resolved (vLLM also stops on the model's)
        stop_ids += [t for t in request.eos_token_ids if t not in stop_ids]
    try:
        return SamplingParams(
            n=1,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else 0,
            seed=s.seed,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty,
            logit_bias=dict(s.logit_bias) if s.logit_bias else None,
            structured_outputs=None if constrain is False else structured_outputs(s.structured),
            max_tokens=stop.max_tokens,
            min_tokens=stop.min_tokens,
            stop_token_ids=stop_ids,
            ignore_eos=stop.ignore_eos,
            logprobs=s.logprobs,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
        )
    except (ValueError, VLLMClientError) as exc:  # vLLM's range checks of the values
        raise InvalidRequest(f"request_id={request.request_id}: {exc}") from exc


def structured_outputs(constraint: StructuredOutput | None) -> Any:
    """tandem's constraint as vLLM's `StructuredOutputsParams` (vLLM's grammar backend, auto:
    xgrammar, or llguidance where xgrammar cannot)."""
    if constraint is None:
        return None
    spec = constraint.spec or ""
    if constraint.kind != "json" and not spec:
        raise InvalidRequest(
            f"structured output kind {constraint.kind!r} without a spec; expected the "
            f"{_SPEC_NAMES[constraint.kind]} as text"
        )
    from vllm.sampling_params import StructuredOutputsParams

    if constraint.kind == "json":
        return StructuredOutputsParams(json_object=True)
    if constraint.kind == "json_schema":
        return StructuredOutputsParams(json=_schema(spec, strict=constraint.strict))
    if constraint.kind == "regex":
        return StructuredOutputsParams(regex=spec)
    return StructuredOutputsParams(grammar=spec)  # Lark: vLLM reads it as such


_SPEC_NAMES = {
    "json_schema": "JSON Schema",
    "regex": "regular expression",
    "grammar": "Lark grammar",
}


def _schema(spec: str, *, strict: bool) -> dict[str, Any]:
    """The schema with `additionalProperties` explicit on every object that leaves it open:
    false when strict (only the named properties), true otherwise (JSON Schema's own default;
    vLLM's xgrammar backend would otherwise close them)."""
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"json_schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise InvalidRequest(f"json_schema must be a JSON object; got {type(schema).__name__}")

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "object" or "properties" in node:
                node.setdefault("additionalProperties", not strict)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


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
