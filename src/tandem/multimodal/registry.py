"""Vision encoders by name: what each declares (rows per image) and how to load it.

The declaration is known without loading the encoder, so a worker can put its image geometry in
its model card at start and load the encoder lazily, on its first image.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tandem.engines.vision import encoder_rows
from tandem.multimodal.base import VisionEncoder

# SmolLM2 has no image token: its special token <empty_output> (id 16), which chat never uses,
# marks the image rows; their embeddings are always replaced, so its own embedding is never read
DEFAULT_PLACEHOLDER_TOKEN_ID = 16


@dataclass(frozen=True, slots=True)
class EncoderSpec:
    num_tokens_per_image: int
    load: Callable[[str | None], VisionEncoder]  # (LM model path or None) -> encoder


def _load_bridge(model: str | None) -> VisionEncoder:
    from tandem.multimodal.encoder.classifier_bridge import EncoderConfig, load_classifier_bridge

    return load_classifier_bridge(EncoderConfig(model=model))


_ENCODERS: dict[str, EncoderSpec] = {
    # MobileNetV2 (ImageNet) + the classifier bridge: 49 spatial rows + 1 pooled global row
    "bridge": EncoderSpec(encoder_rows("bridge"), _load_bridge),
}


def encoder_names() -> list[str]:
    return sorted(_ENCODERS)


def encoder_spec(name: str) -> EncoderSpec:
    spec = _ENCODERS.get(name)
    if spec is None:
        raise ValueError(
            f"unknown vision encoder '{name}'; expected one of: {', '.join(encoder_names())}"
        )
    return spec


def load_encoder(name: str, *, model: str | None = None) -> VisionEncoder:
    """Load encoder `name` for the LM `model` (a .gguf / HF dir; None: the default SmolLM2).
    Blocking (seconds); raises ValueError when the loaded encoder contradicts its spec."""
    spec = encoder_spec(name)
    encoder = spec.load(model)
    if encoder.num_tokens_per_image != spec.num_tokens_per_image:
        raise ValueError(
            f"encoder '{name}' makes {encoder.num_tokens_per_image} rows per image; its spec "
            f"declares {spec.num_tokens_per_image}"
        )
    return encoder
