"""Seams of the multimodal path: who turns images into embeddings, and who hands them to an engine.

A `VisionEncoder` maps decoded images to rows in the language model's input-embedding space
(`[num_tokens_per_image, hidden_size]` per image). An `EmbeddingProvider` gives an engine the
embeddings of one request's images, in `mm_items` order: in-process by calling an encoder (EPD),
or from a cache / an encode worker (E/PD, E/P/D).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from tandem.engines.vision import EmbeddingProvider as _EmbeddingProvider

if TYPE_CHECKING:
    import torch

    from tandem.multimodal.image import DecodedImage


class VisionEncoder(Protocol):
    """Images → input-embedding rows for the language model.

    `num_tokens_per_image` rows per image, each `hidden_size` wide (the LM's embedding width).
    `encode` is synchronous and CPU/GPU-bound (callers run it off the event loop); it is not
    required to be thread-safe, so one caller at a time. It returns one float32 CPU tensor of shape
    `[num_tokens_per_image, hidden_size]` per image, in input order, and raises `ValueError` for an
    image it cannot take.
    """

    num_tokens_per_image: int
    hidden_size: int

    def encode(self, images: Sequence[DecodedImage]) -> list[torch.Tensor]: ...


# the engine-side contract lives with the engines (imports flow down DESIGN §2's table)
EmbeddingProvider = _EmbeddingProvider
