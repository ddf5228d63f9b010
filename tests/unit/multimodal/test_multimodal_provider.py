"""LocalEmbeddingProvider (EPD): decodes each item's bytes, checks its mm_hash, runs the encoder
off the event loop, loaded once on the first image."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from tests.support.images import synthetic_png

from tandem.errors import EngineError, InvalidRequest
from tandem.multimodal.image import DecodedImage, decode_image
from tandem.multimodal.provider import LocalEmbeddingProvider
from tandem.protocols.engine import MmItem, PreprocessedRequest, StopConditions


class _Encoder:
    num_tokens_per_image = 3
    hidden_size = 4

    def __init__(self) -> None:
        self.batches: list[int] = []

    def encode(self, images: Sequence[DecodedImage]) -> list[torch.Tensor]:
        self.batches.append(len(images))
        return [torch.full((3, 4), float(img.pixels[0, 0, 0])) for img in images]


def _request(*items: MmItem) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id="r", model="m", token_ids=[16] * 6, stop=StopConditions(max_tokens=1),
        mm_items=list(items),
    )  # fmt: skip


def _item(seed: int, offset: int = 0, **kw: object) -> MmItem:
    png = synthetic_png(seed=seed)
    fields = {"mm_hash": decode_image(png).mm_hash, "offset": offset, "num_tokens": 3}
    return MmItem(**{**fields, "image_bytes": png, **kw})  # type: ignore[arg-type]


async def test_encodes_every_item_in_order_loading_once() -> None:
    encoder, loads = _Encoder(), []
    provider = LocalEmbeddingProvider(lambda: loads.append(1) or encoder)  # type: ignore[func-returns-value]
    out = await provider.embeddings(_request(_item(1), _item(2, offset=3)))
    await provider.embeddings(_request(_item(3)))
    assert [tuple(t.shape) for t in out] == [(3, 4), (3, 4)]
    expected = [float(decode_image(synthetic_png(seed=s)).pixels[0, 0, 0]) for s in (1, 2)]
    assert [float(t[0, 0]) for t in out] == expected
    assert loads == [1] and encoder.batches == [2, 1] and provider.num_images_encoded == 3


async def test_bytes_must_match_the_declared_hash_and_be_present() -> None:
    provider = LocalEmbeddingProvider(_Encoder)
    with pytest.raises(InvalidRequest, match=r"hashes to .* not the declared mm_hash 0x7"):
        await provider.embeddings(_request(_item(1, mm_hash=7)))
    with pytest.raises(InvalidRequest, match=r"mm_items\[0\] .* carries no image bytes"):
        await provider.embeddings(_request(_item(1, image_bytes=None)))
    with pytest.raises(InvalidRequest, match="cannot decode"):
        await provider.embeddings(_request(_item(1, image_bytes=b"junk")))


async def test_rows_must_match_the_item_span() -> None:
    provider = LocalEmbeddingProvider(_Encoder)
    with pytest.raises(EngineError, match=r"spans 5 rows; the encoder made \(3, 4\)"):
        await provider.embeddings(_request(_item(1, num_tokens=5)))


async def test_a_failed_load_fails_the_request_and_the_next_one_retries() -> None:
    attempts: list[int] = []

    def load() -> _Encoder:
        attempts.append(1)
        if len(attempts) == 1:
            raise FileNotFoundError("no checkpoint")
        return _Encoder()

    provider = LocalEmbeddingProvider(load, name="bridge")
    with pytest.raises(EngineError, match="vision encoder bridge failed to load: no checkpoint"):
        await provider.embeddings(_request(_item(1)))
    assert len(await provider.embeddings(_request(_item(1)))) == 1
