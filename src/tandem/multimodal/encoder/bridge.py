"""The classifier bridge: MobileNetV2 features → rows in the language model's embedding space,
with no trained projector.

Each of the 7×7 feature-map positions, and one globally pooled vector, goes through the
checkpoint's own 1280→1000 ImageNet classifier; a softmax with a temperature turns the logits into
weights over the 1000 class names, and the row is that weighted mix of the class names' input
embeddings (each name embedded as the mean of its tokens' rows in the LM's embedding table),
rescaled to the typical token-embedding norm. The LM thus reads each image token as "something
like <these object names>": the bridge names objects; it carries no text, counts or layout
beyond which names dominate which positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import torch

from tandem.config_check import check_range
from tandem.multimodal.encoder.mobilenet import FEATURE_CHANNELS, NUM_CLASSES

GRID_TOKENS = 49  # 7×7 positions of the last feature map at 224×224
GLOBAL_TOKENS = 1


def imagenet_class_names() -> list[str]:
    """The 1000 ImageNet-1k class names in the classifier's index order (shipped data file)."""
    text = resources.files(__package__).joinpath("imagenet_classes.txt").read_text("utf-8")
    names = [line.strip() for line in text.splitlines() if line.strip()]
    if len(names) != NUM_CLASSES:
        raise ValueError(f"imagenet_classes.txt has {len(names)} names, want {NUM_CLASSES}")
    return names


def class_name_embeddings(
    names: Sequence[str], token_ids: Sequence[Sequence[int]], embed_table: torch.Tensor
) -> torch.Tensor:
    """`[len(names), hidden]`: each name's embedding is the mean of its tokens' rows."""
    rows = []
    for name, ids in zip(names, token_ids, strict=True):
        if not ids:
            raise ValueError(f"class name {name!r} tokenizes to no tokens")
        rows.append(embed_table[list(ids)].mean(dim=0))
    return torch.stack(rows)


@dataclass(frozen=True, slots=True, kw_only=True)
class BridgeConfig:
    """`temperature` divides the classifier logits before the softmax (lower: the top class
    dominates each row). `top_k` keeps only the k most likely classes per row (renormalised);
    None mixes all 1000 below temperature 1 and the top 5 above it, where a flat softmax would
    blur every row towards the mean name."""

    temperature: float = 0.7
    top_k: int | None = None

    def __post_init__(self) -> None:
        check_range("temperature", self.temperature, low=0.05, high=10)
        if self.top_k is not None:
            check_range("top_k", self.top_k, low=1, high=NUM_CLASSES)

    @property
    def effective_top_k(self) -> int | None:
        if self.top_k is not None:
            return self.top_k
        return 5 if self.temperature > 1.0 else None


class ClassifierBridge:
    """Projects `[B, 1280, 7, 7]` features to `[B, 50, hidden]` rows: 49 spatial tokens
    (row-major over the grid) then one pooled global token. Stateless after construction;
    safe to call from several threads."""

    num_tokens = GRID_TOKENS + GLOBAL_TOKENS

    def __init__(
        self,
        classifier_weight: torch.Tensor,
        classifier_bias: torch.Tensor,
        class_embeddings: torch.Tensor,
        target_norm: float,
        config: BridgeConfig,
    ) -> None:
        if tuple(classifier_weight.shape) != (NUM_CLASSES, FEATURE_CHANNELS):
            raise ValueError(f"classifier weight shape {tuple(classifier_weight.shape)}")
        if class_embeddings.shape[0] != NUM_CLASSES:
            raise ValueError(f"class embeddings have {class_embeddings.shape[0]} rows")
        self.weight_t = classifier_weight.t().contiguous()
        self.bias = classifier_bias
        self.class_embeddings = class_embeddings.float().contiguous()
        self.hidden_size = int(class_embeddings.shape[1])
        self.target_norm = float(target_norm)
        self.config = config

    def project(self, features: torch.Tensor) -> torch.Tensor:
        if features.ndim != 4 or features.shape[1] != FEATURE_CHANNELS:
            raise ValueError(f"features must be [B, {FEATURE_CHANNELS}, H, W]")
        batch = features.shape[0]
        spatial = features.flatten(2).transpose(1, 2)  # [B, H*W, 1280]
        if spatial.shape[1] != GRID_TOKENS:
            raise ValueError(f"feature map has {spatial.shape[1]} positions, want {GRID_TOKENS}")
        pooled = features.mean(dim=(2, 3)).unsqueeze(1)  # what the classifier itself sees
        vectors = torch.cat([spatial, pooled], dim=1)  # [B, 50, 1280]
        logits = torch.addmm(self.bias, vectors.reshape(-1, FEATURE_CHANNELS), self.weight_t)
        weights = self._mixing_weights(logits)  # [B*50, 1000]
        rows = weights @ self.class_embeddings
        rows *= self.target_norm / rows.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return rows.view(batch, self.num_tokens, self.hidden_size)

    def _mixing_weights(self, logits: torch.Tensor) -> torch.Tensor:
        scaled = logits / self.config.temperature
        top_k = self.config.effective_top_k
        if top_k is None:
            return torch.softmax(scaled, dim=-1)
        values, indices = scaled.topk(top_k, dim=-1)
        return torch.zeros_like(scaled).scatter_(-1, indices, torch.softmax(values, dim=-1))
