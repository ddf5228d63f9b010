"""LoRA adapters shared by every engine (issue 32): reading and checking one in the PEFT
layout, and the slots a worker keeps them in.

`read_peft_adapter` reads a directory holding `adapter_config.json` and
`adapter_model.safetensors` (what `peft`'s `save_pretrained` writes) against the base model's
`LoraShape`; each bad input is an InvalidRequest naming the problem (another base model, a
wrong shape or rank, a target module the model lacks, a missing or corrupt file), so a load
either succeeds whole or changes nothing. Adapters load from local directories only: which
directories are allowed is the caller's business (the frontend's `--lora-dir`).

`LoraSlots` is the resident set of a worker: at most `max_loras` adapters, the least recently
used idle one evicted for a new one, never one a running request uses.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from tandem.config_check import check_range
from tandem.errors import InvalidRequest, ModelNotFound, Overloaded

# PEFT's names of the seven projections of a llama-family layer, in the order of the layer
PEFT_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_LORA_RANK = 256  # the largest rank an adapter may have (the issue asks for >= 64)
DEFAULT_MAX_LORAS = 4  # adapters resident at once on a worker (`--max-loras`)
MAX_LORAS_LIMIT = 1024
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_KEY = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])(?:\.default)?\.weight"
)
# adapter_config.json fields that change what the adapter computes and that tandem does not
# honour: an adapter using one is refused, never served as something else
_UNSUPPORTED: dict[str, str] = {
    "use_dora": "DoRA",
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layer_replication": "layer_replication",
    "fan_in_fan_out": "fan_in_fan_out",
}


@dataclass(frozen=True, slots=True)
class LoraShape:
    """What an adapter must fit: the base model's name, its layer count and each PEFT
    module's (in_features, out_features)."""

    base_model: str
    num_layers: int
    dims: dict[str, tuple[int, int]]

    @classmethod
    def llama(
        cls,
        base_model: str,
        *,
        num_layers: int,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        ffn: int,
    ) -> LoraShape:
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        dims = {
            "q_proj": (hidden, q),
            "k_proj": (hidden, kv),
            "v_proj": (hidden, kv),
            "o_proj": (q, hidden),
            "gate_proj": (hidden, ffn),
            "up_proj": (hidden, ffn),
            "down_proj": (ffn, hidden),
        }
        return cls(base_model, num_layers, dims)


@dataclass(frozen=True, slots=True)
class LoraWeights:
    """One adapter as read: y += scale * (x A^T) B^T for each (layer, module) it has, with
    A [rank, in] and B [out, rank] in float32 (torch tensors)."""

    name: str
    path: str
    rank: int
    scale: float  # lora_alpha / rank (lora_alpha / sqrt(rank) with use_rslora)
    base_model: str | None  # as adapter_config.json names it
    modules: tuple[str, ...]  # the PEFT modules it adapts, in PEFT_MODULES order
    a: dict[tuple[int, str], Any]  # (layer, module) -> A
    b: dict[tuple[int, str], Any]  # (layer, module) -> B

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * 4 for t in (*self.a.values(), *self.b.values()))


def read_peft_adapter(path: Path | str, shape: LoraShape, *, name: str = "") -> LoraWeights:
    """Read and check the PEFT adapter in directory `path` against `shape`; InvalidRequest
    naming the problem for anything tandem cannot serve exactly."""
    import torch  # only here: a frontend checks paths without torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path)
    label = f"LoRA adapter '{name or root.name}' ({root})"
    if not root.is_dir():
        raise InvalidRequest(f"{label}: not a directory; expected a PEFT adapter directory")
    config = _read_config(root / CONFIG_FILE, label)
    rank, scale, targets = _check_config(config, shape, label)
    weights_path = root / WEIGHTS_FILE
    if not weights_path.is_file():
        other = (
            " (adapter_model.bin is not read: save with safe_serialization)"
            * (root / "adapter_model.bin").is_file()
        )
        raise InvalidRequest(f"{label}: no {WEIGHTS_FILE}{other}")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise InvalidRequest(f"{label}: {WEIGHTS_FILE} is corrupt: {exc}") from None
    a: dict[tuple[int, str], torch.Tensor] = {}
    b: dict[tuple[int, str], torch.Tensor] = {}
    for key, tensor in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise InvalidRequest(
                f"{label}: tensor '{key}' is not a LoRA A/B weight of a "
                f"{'/'.join(PEFT_MODULES)} projection; tandem serves only those"
            )
        layer, module, which = int(m[1]), m[2], m[3]
        if layer >= shape.num_layers:
            raise InvalidRequest(
                f"{label}: tensor '{key}' is for layer {layer}; base model "
                f"'{shape.base_model}' has {shape.num_layers} layers (an adapter of "
                f"another base model: {config.get('base_model_name_or_path')!r}?)"
            )
        if module not in targets:
            raise InvalidRequest(
                f"{label}: tensor '{key}' adapts {module}, which target_modules "
                f"{sorted(targets)} does not list"
            )
        d_in, d_out = shape.dims[module]
        want = (rank, d_in) if which == "A" else (d_out, rank)
        if tuple(tensor.shape) != want:
            raise InvalidRequest(
                f"{label}: '{key}' has shape {list(tensor.shape)}; rank {rank} on base model "
                f"'{shape.base_model}' needs {list(want)} (an adapter of another base model: "
                f"{config.get('base_model_name_or_path')!r}, or r does not match the weights?)"
            )
        if not tensor.is_floating_point():
            raise InvalidRequest(f"{label}: '{key}' is {tensor.dtype}; expected floating point")
        t = tensor.to(torch.float32)
        if not bool(torch.isfinite(t).all()):
            raise InvalidRequest(f"{label}: '{key}' holds NaN or infinite values")
        (a if which == "A" else b)[(layer, module)] = t
    if not a and not b:
        raise InvalidRequest(f"{label}: {WEIGHTS_FILE} holds no LoRA weights")
    for layer, module in sorted(a.keys() ^ b.keys()):
        missing = "B" if (layer, module) in a else "A"
        raise InvalidRequest(f"{label}: layer {layer} {module} has no lora_{missing} weight")
    modules = tuple(m for m in PEFT_MODULES if any(k[1] == m for k in a))
    base = config.get("base_model_name_or_path")
    return LoraWeights(
        name=name or root.name,
        path=str(root),
        rank=rank,
        scale=scale,
        base_model=base if isinstance(base, str) else None,
        modules=modules,
        a=a,
        b=b,
    )


def _read_config(path: Path, label: str) -> dict[str, Any]:
    if not path.is_file():
        raise InvalidRequest(f"{label}: no {CONFIG_FILE}; expected a PEFT adapter directory")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"{label}: {CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidRequest(f"{label}: {CONFIG_FILE} is not a JSON object")
    return config


def _check_config(
    config: dict[str, Any], shape: LoraShape, label: str
) -> tuple[int, float, set[str]]:
    """(rank, scale, target modules) of a PEFT LoRA config; InvalidRequest otherwise."""
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise InvalidRequest(f"{label}: peft_type is {kind!r}; tandem serves LORA only")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= MAX_LORA_RANK:
        raise InvalidRequest(f"{label}: r={rank!r}; expected an integer in [1, {MAX_LORA_RANK}]")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise InvalidRequest(f"{label}: lora_alpha={alpha!r}; expected a finite number")
    rslora = bool(config.get("use_rslora", False))
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    for field, what in _UNSUPPORTED.items():
        if config.get(field):
            raise InvalidRequest(f"{label}: uses {what}, which tandem does not serve")
    if config.get("bias", "none") != "none":
        raise InvalidRequest(f"{label}: bias={config['bias']!r}; tandem serves bias='none' only")
    if config.get("layers_pattern"):
        raise InvalidRequest(f"{label}: layers_pattern is not served; expected none")
    return rank, scale, _targets(config.get("target_modules"), shape, label)


def _targets(raw: Any, shape: LoraShape, label: str) -> set[str]:
    """The PEFT modules `target_modules` selects: a list of names (each must be one of the
    seven projections) or a regular expression over full module names (PEFT's meaning)."""
    known = ", ".join(PEFT_MODULES)
    if isinstance(raw, str):
        if raw in PEFT_MODULES:
            return {raw}
        if raw == "all-linear":
            return set(PEFT_MODULES)
        try:
            pattern = re.compile(raw)
        except re.error as exc:
            why = f"target_modules {raw!r} is not a pattern: {exc}"
            raise InvalidRequest(f"{label}: {why}") from None
        found = {
            m
            for m in PEFT_MODULES
            for i in range(shape.num_layers)
            for group in ("self_attn", "mlp")
            if pattern.fullmatch(f"model.layers.{i}.{group}.{m}")
        }
        if not found:
            raise InvalidRequest(f"{label}: target_modules {raw!r} matches none of: {known}")
        return found
    if not isinstance(raw, list) or not raw or not all(isinstance(m, str) for m in raw):
        raise InvalidRequest(
            f"{label}: target_modules={raw!r}; expected a non-empty list of names from: {known}"
        )
    names = {m.rsplit(".", 1)[-1] for m in raw}
    if bad := sorted(names - set(PEFT_MODULES)):
        raise InvalidRequest(
            f"{label}: target module(s) {bad} not in base model '{shape.base_model}'; "
            f"tandem adapts: {known}"
        )
    return names


# ---------------------------------------------------------------------------- slots
T = TypeVar("T")


class LoraSlots(Generic[T]):
    """The adapters resident on one worker, least recently used first. Not thread-safe: the
    owner serialises calls (the native engine: under its step lock)."""

    def __init__(self, max_loras: int) -> None:
        check_range("max_loras", max_loras, low=0, high=MAX_LORAS_LIMIT)
        self.max_loras = max_loras
        self._items: OrderedDict[str, T] = OrderedDict()

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __len__(self) -> int:
        return len(self._items)

    def names(self) -> list[str]:
        """Resident adapters, least recently used first."""
        return list(self._items)

    def peek(self, name: str) -> T | None:
        return self._items.get(name)

    def use(self, name: str) -> T:
        """The adapter `name` for a request (now the most recently used); ModelNotFound
        naming it when it is not resident."""
        item = self._items.get(name)
        if item is None:
            raise ModelNotFound(
                f"LoRA adapter '{name}' is not loaded on this worker (resident: "
                f"{', '.join(self._items) or 'none'})"
            )
        self._items.move_to_end(name)
        return item

    def add(self, name: str, item: T, busy: Collection[str] = ()) -> list[str]:
        """Make `name` resident (replacing an entry of that name); evicts the least recently
        used adapters not in `busy` (those running requests use) while the slots are full.
        Returns the evicted names; Overloaded when every slot is busy (nothing changed)."""
        if self.max_loras == 0:
            raise InvalidRequest(
                "this worker serves no LoRA adapters (--max-loras 0); start it with "
                "--max-loras N to load some"
            )
        evicted: list[str] = []
        if name not in self._items:
            excess = len(self._items) + 1 - self.max_loras
            idle = [n for n in self._items if n not in busy][: max(excess, 0)]
            if len(idle) < excess:
                raise Overloaded(
                    f"cannot load LoRA adapter '{name}': all {self.max_loras} adapter slots "
                    "(--max-loras) hold adapters that running requests use; retry later"
                )
            for victim in idle:
                del self._items[victim]
                evicted.append(victim)
        self._items[name] = item
        self._items.move_to_end(name)
        return evicted

    def remove(self, name: str) -> T:
        """Drop `name`; ModelNotFound when it is not resident."""
        item = self._items.pop(name, None)
        if item is None:
            raise ModelNotFound(f"LoRA adapter '{name}' is not loaded on this worker")
        return item


def add_max_loras_arg(group: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    """`--max-loras` of every engine that serves LoRA adapters (one meaning everywhere)."""
    group.add_argument(
        "--max-loras",
        type=int,
        default=DEFAULT_MAX_LORAS,
        help="LoRA adapters resident at once on this worker; loading one more evicts the "
        "least recently used idle one (0: serve no adapters)",
    )
