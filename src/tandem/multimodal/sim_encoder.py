"""`SimVisionEncoder`: a simulated encoder for routing, scale and benchmark runs (no torch).

Time per batch comes from a linear perf model, `base_ms + ms_per_image × images` (fit it to
`tandem bench multimodal`'s measured encoder ms/image), divided by `speedup_ratio` like the
mocker's steps; the rows are deterministic pseudo-random float32 values seeded by the image's
mm_hash, so the same image always yields the same embedding.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tandem.config_check import check_range

if TYPE_CHECKING:
    from tandem.multimodal.image import DecodedImage


@dataclass(frozen=True, slots=True, kw_only=True)
class SimEncoderConfig:
    num_tokens_per_image: int = 50
    hidden_size: int = 576
    base_ms: float = 1.0
    ms_per_image: float = 8.0
    speedup_ratio: float = 1.0  # 0: never sleep

    def __post_init__(self) -> None:
        check_range("num_tokens_per_image", self.num_tokens_per_image, low=1)
        check_range("hidden_size", self.hidden_size, low=1)
        check_range("base_ms", self.base_ms, low=0)
        check_range("ms_per_image", self.ms_per_image, low=0)
        check_range("speedup_ratio", self.speedup_ratio, low=0)

    def batch_seconds(self, num_images: int) -> float:
        if self.speedup_ratio == 0 or num_images == 0:
            return 0.0
        return (self.base_ms + self.ms_per_image * num_images) / 1000.0 / self.speedup_ratio


class SimVisionEncoder:
    """Implements `VisionEncoder` with numpy rows (a `[num_tokens, hidden]` float32 array per
    image; consumers that need tensors wrap them). Blocks the calling thread for the modelled
    time. Stateless; thread-safe."""

    def __init__(self, config: SimEncoderConfig | None = None) -> None:
        self.config = config or SimEncoderConfig()
        self.num_tokens_per_image = self.config.num_tokens_per_image
        self.hidden_size = self.config.hidden_size

    def encode(self, images: Sequence[DecodedImage]) -> list[np.ndarray]:
        seconds = self.config.batch_seconds(len(images))
        if seconds > 0:
            time.sleep(seconds)
        return [self.rows(img.mm_hash) for img in images]

    def rows(self, mm_hash: int) -> np.ndarray:
        rng = np.random.default_rng(mm_hash)
        shape = (self.num_tokens_per_image, self.hidden_size)
        return (rng.standard_normal(shape, dtype=np.float32) * 0.05).astype(np.float32)
