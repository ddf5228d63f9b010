"""The shape of a llama-family model, read from GGUF metadata or an HF config.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tandem.config_check import check_range


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """Architecture hyper-parameters; everything `LlamaModel` needs besides weights."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    context_length: int = 2048
    eos_token_ids: tuple[int, ...] = ()
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        check_range("num_layers", self.num_layers, low=1)
        check_range("hidden_size", self.hidden_size, low=1)
        check_range("intermediate_size", self.intermediate_size, low=1)
        check_range("num_heads", self.num_heads, low=1)
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
            )
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be a positive even number")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["eos_token_ids"] = list(self.eos_token_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        return cls(**data)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str) -> ModelConfig:
        """From a HF `config.json` dict of a llama-family model."""
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            name=name,
            num_layers=int(hf["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            vocab_size=int(hf["vocab_size"]),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            context_length=int(hf.get("max_position_embeddings", 2048)),
            eos_token_ids=eos_ids,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )

    def to_hf(self) -> dict[str, Any]:
        """A HF `config.json` dict (LlamaForCausalLM) describing this model."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.context_length,
            "eos_token_id": list(self.eos_token_ids),
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }
