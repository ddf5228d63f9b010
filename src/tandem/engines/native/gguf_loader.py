"""Read a llama-family GGUF file into HF-named fp32 numpy weights.

Quantized tensors (Q4_1, Q8_0, ...) are dequantized with `gguf.quants.dequantize`.
llama.cpp's converter permutes the rows of Q and K so that its RoPE rotates adjacent
pairs; we undo that so the weights match HF's rotate-half layout.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from tandem.engines.native.model_config import ModelConfig

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class GgufFormatError(ValueError):
    """The file is not a llama GGUF we can serve; the message names the file and what is wrong."""


def hf_name(gguf_name: str) -> str | None:
    """HF parameter name of a GGUF tensor name (None for tensors we do not use)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def gguf_name(hf: str) -> str:
    """GGUF tensor name of a HF parameter name (inverse of `hf_name`)."""
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in fixed:
        return fixed[hf]
    parts = hf.split(".")
    reverse = {v: k for k, v in _LAYER_NAMES.items()}
    return f"blk.{parts[2]}.{reverse['.'.join(parts[3:-1])]}.weight"


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(w, n_head)` on Q/K projection rows."""
    out_dim = weight.shape[0]
    return (
        weight.reshape(num_heads, out_dim // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _field(reader: Any, key: str, path: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise GgufFormatError(f"{path}: missing metadata key '{key}'")
        return default
    return field.contents()


def read_config(reader: Any, path: str) -> ModelConfig:
    arch = _field(reader, "general.architecture", path)
    if arch != "llama":
        raise GgufFormatError(f"{path}: architecture '{arch}' is not supported; expected 'llama'")
    num_heads = int(_field(reader, "llama.attention.head_count", path))
    hidden = int(_field(reader, "llama.embedding_length", path))
    names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, "llama.vocab_size", path, len(tokens.data) if tokens else 0)
    eos = _field(reader, "tokenizer.ggml.eos_token_id", path, -1)
    return ModelConfig(
        name=str(_field(reader, "general.name", path, os.path.basename(path))),
        num_layers=int(_field(reader, "llama.block_count", path)),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length", path)),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", path, num_heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", path, hidden // num_heads)),
        vocab_size=int(vocab),
        rope_theta=float(_field(reader, "llama.rope.freq_base", path, 10000.0)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", path, 1e-5)),
        context_length=int(_field(reader, "llama.context_length", path, 2048)),
        eos_token_ids=() if int(eos) < 0 else (int(eos),),
        tie_word_embeddings="output.weight" not in names,
    )


def required_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_layers):
        names += [f"model.layers.{i}.{n}.weight" for n in _LAYER_NAMES.values()]
    return names


def read_gguf(
    path: str, progress: Callable[[int], None] | None = None
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and fp32 weights (HF names, HF layout) of the llama GGUF at `path`.

    Raises GgufFormatError naming the file and the missing tensor or key.
    """
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise GgufFormatError(f"{path}: cannot read as GGUF: {exc}") from exc
    config = read_config(reader, path)
    weights: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            array = np.array(tensor.data, dtype=np.float32)  # copy: the memmap is read-only
        else:
            array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        array = array.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if name.endswith("q_proj.weight"):
            array = unpermute_rows(array, config.num_heads)
        elif name.endswith("k_proj.weight"):
            array = unpermute_rows(array, config.num_kv_heads)
        weights[name] = np.ascontiguousarray(array)
        if progress is not None:
            progress(1)
    _check_complete(path, config, weights)
    return config, weights


def _check_complete(path: str, config: ModelConfig, weights: dict[str, Any]) -> None:
    missing = [n for n in required_names(config) if n not in weights]
    if missing:
        raise GgufFormatError(
            f"{path}: missing tensor '{gguf_name(missing[0])}' ({missing[0]}); "
            f"{len(missing)} missing in all"
        )


def read_gguf_packed(path: str) -> tuple[ModelConfig, dict[str, Any]]:
    """Config and weights of the llama GGUF at `path` with Q4_1 / Q8_0 tensors kept as their
    quantized blocks (`quant.Q4Weight` / `quant.Q8Weight`, Q/K rows unpermuted), never
    expanded to fp32; other tensors as fp32 torch tensors."""
    import torch
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    from tandem.engines.native.quant import from_gguf_blocks

    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise GgufFormatError(f"{path}: cannot read as GGUF: {exc}") from exc
    config = read_config(reader, path)
    weights: dict[str, Any] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape))
        kind = tensor.tensor_type.name
        heads = {"q_proj.weight": config.num_heads, "k_proj.weight": config.num_kv_heads}
        num_heads = next((h for suffix, h in heads.items() if name.endswith(suffix)), None)
        if kind in ("Q4_1", "Q8_0") and len(shape) == 2:
            packed = from_gguf_blocks(tensor.data, kind, (shape[0], shape[1]))
            if num_heads is not None:
                order = unpermute_rows(np.arange(shape[0]), num_heads)
                packed = type(packed)(*(t[torch.from_numpy(order)] for t in packed))
            weights[name] = packed
            continue
        if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            array = np.array(tensor.data, dtype=np.float32)
        else:
            array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        array = array.reshape(shape)
        if num_heads is not None:
            array = unpermute_rows(array, num_heads)
        weights[name] = torch.from_numpy(np.ascontiguousarray(array))
    _check_complete(path, config, weights)
    return config, weights
