"""What an engine must know of the vision encoders without loading one (DESIGN.md §10): the
names, the embedding rows each makes per image, and the `EmbeddingProvider` contract through
which an engine receives a request's image rows. Loading and running the encoders is
`tandem.multimodal`'s; a worker's wiring (`tandem.multimodal.provider_args`) hands the
engine its provider, so engines never import the package above them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from tandem.protocols.engine import PreprocessedRequest

# name -> embedding rows per image; MobileNetV2 + the classifier bridge: 49 spatial + 1 pooled
ENCODER_ROWS: dict[str, int] = {"bridge": 50}


def encoder_rows(name: str) -> int:
    """Rows per image of encoder `name`; ValueError naming the known encoders."""
    rows = ENCODER_ROWS.get(name)
    if rows is None:
        raise ValueError(
            f"unknown vision encoder '{name}'; expected one of: {', '.join(sorted(ENCODER_ROWS))}"
        )
    return rows


class EmbeddingProvider(Protocol):
    """Where an engine gets a request's image embeddings.

    `embeddings(request)` returns one float32 CPU tensor `[item.num_tokens, hidden_size]` per
    `request.mm_items` entry, in order. May be awaited concurrently for different requests.
    Raises `tandem.errors.InvalidRequest` for an image it cannot decode, `EngineError` (or a
    subclass) when the embeddings cannot be produced (encoder gone, transfer failed).
    """

    async def embeddings(self, request: PreprocessedRequest) -> list[torch.Tensor]: ...
