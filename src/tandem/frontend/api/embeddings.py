"""`POST /v1/embeddings`: inputs → token ids → one routed call to a worker's `embed` endpoint.

1. Decode and check the request (`protocols/openai_embedding.py`); the model must have a
   worker that embeds (its card lists the "embed" task), else 400 naming the model.
2. Take one admission slot (the frontend's in-flight bound, 503 + Retry-After past it).
3. Tokenize text inputs; check each input's token ids (vocabulary) and length (context),
   the request's total tokens, and `dimensions` (400 naming `input[i]` or the field).
4. The model's router picks a worker among those that embed and the whole batch goes in one
   `EmbedRequest` (`embedder.Embedder`, shared with `/v1/rerank` and `/v1/score`).
5. Vectors come back as one float32 matrix; `dimensions` keeps a prefix and renormalises (only
   on models whose card declares Matryoshka training, as OpenAI refuses `dimensions` for
   text-embedding-ada-002); `encoding_format` float (JSON numbers) or base64 (the vector's
   little-endian float32 bytes, as OpenAI sends them).
"""

from __future__ import annotations

import base64
import uuid
from typing import Any

import msgspec
import numpy as np

from tandem.errors import InvalidRequest
from tandem.frontend import errors as http_errors
from tandem.frontend.api.embedder import Embedder, vectors
from tandem.frontend.http.server import HttpRequest, HttpResponse
from tandem.frontend.models import ModelRegistry
from tandem.frontend.observability.metrics import count_as
from tandem.protocols.discovery import ModelCard
from tandem.protocols.embedding import EmbedResponse
from tandem.protocols.openai_embedding import (
    EmbeddingRequest,
    embedding_inputs,
    validate_embedding,
)

_decoder = msgspec.json.Decoder(EmbeddingRequest)
_json = msgspec.json.Encoder()


class EmbeddingsEndpoint:
    """The handler of `POST /v1/embeddings`; one per frontend, safe for concurrent use."""

    def __init__(self, registry: ModelRegistry, embedder: Embedder) -> None:
        self.registry, self.embedder = registry, embedder

    async def __call__(self, http: HttpRequest, response: HttpResponse) -> None:
        try:
            req = _decoder.decode(http.body)
        except http_errors.BODY_ERRORS as exc:
            raise http_errors.decode_error(exc, http.body) from exc
        validate_embedding(req)
        texts, params = embedding_inputs(req.input)
        model = self.registry.get(req.model)
        model.require_task("embed", "/v1/embeddings")
        count_as(model.name, stream=False)
        request_id = f"embd-{uuid.uuid4().hex}"
        embedder = self.embedder
        with (
            embedder.pipeline.admission.slots(1),  # one engine call, however many inputs
            embedder.accounted(http, model.name, request_id) as tally,
        ):
            await model.ready()
            card = model.require_task("embed", "/v1/embeddings")  # instances may change
            dim = _dimensions(req, card, model.name)
            inputs = embedder.token_ids(model, texts, params)
            embedder.check(model, card, inputs, params, total_param="input")
            result = await embedder.embed(http, model, inputs, request_id)
            tally.num_tokens = result.num_tokens
            await response.send(200, _body(req, model.name, result, dim))


def _dimensions(req: EmbeddingRequest, card: ModelCard, name: str) -> int:
    """The width of the answer's vectors; raises InvalidRequest for a `dimensions` the model
    cannot give (wider than its vectors, or narrower on a model not trained for it)."""
    native = card.embedding_dim
    if req.dimensions is None or req.dimensions == native:
        return native
    if req.dimensions > native:
        raise InvalidRequest(
            f"dimensions={req.dimensions} is invalid; model '{name}' gives {native}-dimensional "
            f"embeddings: expected 1 to {native}",
            param="dimensions",
        )
    if not card.embedding_matryoshka:
        raise InvalidRequest(
            f"dimensions={req.dimensions} is not supported by model '{name}': it was not "
            f"trained to make shortened embeddings meaningful (Matryoshka); omit dimensions "
            f"or send {native}",
            param="dimensions",
        )
    return req.dimensions


def _body(req: EmbeddingRequest, model: str, result: EmbedResponse, dim: int) -> bytes:
    matrix = vectors(result)
    if dim < result.dim:  # Matryoshka: a prefix, renormalised
        matrix = matrix[:, :dim]
        matrix = matrix / np.linalg.norm(matrix, axis=1, keepdims=True)
    matrix = matrix.astype("<f4", copy=False)
    data: list[dict[str, Any]] = []
    for i, row in enumerate(matrix):
        vector: Any = (
            base64.b64encode(row.tobytes()).decode()
            if req.encoding_format == "base64"
            else row.tolist()
        )
        data.append({"object": "embedding", "index": i, "embedding": vector})
    usage = {"prompt_tokens": result.num_tokens, "total_tokens": result.num_tokens}
    return _json.encode({"object": "list", "data": data, "model": model, "usage": usage})
