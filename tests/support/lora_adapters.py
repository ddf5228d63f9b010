"""PEFT-layout LoRA adapters for SmolLM2-135M written by tests (random non-zero weights from a
seed, as peft saves them; nothing downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

MODEL = "smollm2"
HIDDEN, KV, LAYERS = 576, 192, 30  # SmolLM2-135M: q/o 576 -> 576, k/v 576 -> 192


def write_adapter(
    root: Path,
    name: str,
    *,
    rank: int = 8,
    config_rank: int | None = None,
    hidden: int = HIDDEN,
    layers: int = LAYERS,
    modules: tuple[str, ...] = ("q_proj", "v_proj"),
    seed: int = 0,
) -> Path:
    """A PEFT-layout adapter with random non-zero weights (as peft saves them)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    out = {"q_proj": hidden, "o_proj": hidden, "k_proj": KV, "v_proj": KV, "foo_proj": hidden}
    tensors = {}
    for i in range(layers):
        for m in modules:
            key = f"base_model.model.model.layers.{i}.self_attn.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.05
            tensors[f"{key}.lora_B.weight"] = torch.randn(out[m], rank, generator=gen) * 0.5
    path = root / name
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": config_rank or rank, "lora_alpha": 2 * rank,
              "target_modules": list(modules), "bias": "none",
              "base_model_name_or_path": MODEL}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path
