"""`LocalEmbeddingProvider`: EPD — the worker decodes each request's images and runs a vision
encoder in-process (DESIGN.md §10, step 4).

The encoder is loaded on the first image (seconds; text-only serving never pays it), in a thread,
and runs in a thread one batch at a time, so the event loop stays responsive while it computes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from tandem.errors import EngineError, InvalidRequest
from tandem.multimodal.base import VisionEncoder
from tandem.multimodal.image import DecodedImage, decode_image

if TYPE_CHECKING:
    import torch

    from tandem.protocols.engine import MmItem, PreprocessedRequest

logger = logging.getLogger(__name__)


class LocalEmbeddingProvider:
    """Implements `EmbeddingProvider` with an in-process `VisionEncoder`.

    `load` builds the encoder (called once, off the event loop; a failure is raised to the
    request that triggered it as EngineError, and retried by the next). Safe for concurrent
    `embeddings` calls: encoder runs are serialised."""

    def __init__(self, load: Callable[[], VisionEncoder], *, name: str = "encoder") -> None:
        self._load = load
        self.name = name
        self._encoder: VisionEncoder | None = None
        self._load_lock = threading.Lock()
        self._run_lock = asyncio.Lock()
        self.num_images_encoded = 0

    def _encoder_now(self) -> VisionEncoder:
        with self._load_lock:
            if self._encoder is None:
                logger.info("loading vision encoder %s", self.name)
                self._encoder = self._load()
            return self._encoder

    async def embeddings(self, request: PreprocessedRequest) -> list[torch.Tensor]:
        items = request.mm_items
        if not items:
            return []
        images = await asyncio.to_thread(_decode_items, items)
        async with self._run_lock:
            try:
                encoder = await asyncio.to_thread(self._encoder_now)
            except Exception as exc:  # request boundary: this request fails, the next retries
                logger.exception("vision encoder %s failed to load", self.name)
                raise EngineError(f"vision encoder {self.name} failed to load: {exc}") from exc
            rows = await asyncio.to_thread(encoder.encode, images)
        self.num_images_encoded += len(images)
        for i, (item, emb) in enumerate(zip(items, rows, strict=True)):
            if tuple(emb.shape) != (item.num_tokens, encoder.hidden_size):
                raise EngineError(
                    f"mm_items[{i}] spans {item.num_tokens} rows; the encoder made "
                    f"{tuple(emb.shape)} (expected [{item.num_tokens}, {encoder.hidden_size}])"
                )
        return rows


def _decode_items(items: list[MmItem]) -> list[DecodedImage]:
    """Decode each item's image bytes; the pixels must hash to the item's mm_hash (the router
    and the prefix cache keyed the request on it)."""
    images = []
    for i, item in enumerate(items):
        if item.image_bytes is None:
            raise InvalidRequest(
                f"mm_items[{i}] (mm_hash={item.mm_hash:#x}) carries no image bytes and this "
                "worker has no embedding for it",
                param=f"mm_items[{i}]",
            )
        image = decode_image(item.image_bytes, what=f"mm_items[{i}]")
        if image.mm_hash != item.mm_hash:
            raise InvalidRequest(
                f"mm_items[{i}]: the image hashes to {image.mm_hash:#x}, not the declared "
                f"mm_hash {item.mm_hash:#x}",
                param=f"mm_items[{i}]",
            )
        images.append(image)
    return images
