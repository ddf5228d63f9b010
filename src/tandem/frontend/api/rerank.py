"""`POST /v1/rerank` (also `/rerank`, `/v2/rerank`) and `POST /v1/score` (also `/score`):
vLLM's routes, in the Jina / Cohere rerank shape and vLLM's score shape
(`protocols/rerank.py`).

What the score is: tandem serves no cross-encoder, so a score is the **cosine similarity of
the embeddings `/v1/embeddings` returns for the two texts** (`engines/native/embedding.py` on
the native engine: the mean over the text's tokens of SmolLM2's last hidden layer, L2
normalised). It lies in [-1, 1]; SmolLM2 was never trained as an embedder, so its vectors
share a large common direction and unrelated English sentences still score about 0.75-0.9:
the values are not calibrated relevance probabilities, and only their order within one
request means something (a trained reranker would do better). On the mocker the vectors are
hash-seeded (`engines/mocker/embedding.py`): equal token ids score 1, anything else noise.

1. Decode and check the body (400 naming the field); the model must have a worker that
   embeds (its card lists the "embed" task), else 400 naming the model and the route.
2. One admission slot; every text (the query and the documents, or both sides of the pairs,
   a lone `text_1` embedded once) is tokenized, cut as asked (vLLM's `max_tokens_per_query`,
   `max_tokens_per_doc`: the first N tokens; `truncate_prompt_tokens`: the last N, or the
   first with `truncation_side: right`),
   checked (vocabulary, context length, MAX_TOTAL_TOKENS in all) and sent in one routed
   embed call (`embedder.Embedder`, the path `/v1/embeddings` takes).
3. Scores are dot products of the unit vectors; rerank sorts them best first (ties: the
   earlier document) and keeps `top_n`; usage counts every token embedded.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import TypeVar

import msgspec
import numpy as np

from tandem.frontend import errors as http_errors
from tandem.frontend.api.embedder import Embedder, vectors
from tandem.frontend.http.server import HttpRequest, HttpResponse
from tandem.frontend.models import ModelRegistry, ServedModel
from tandem.frontend.observability.metrics import count_as
from tandem.protocols.rerank import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    ScoreUsage,
    validate_rerank,
    validate_score,
)

_Request = TypeVar("_Request", RerankRequest, ScoreRequest)
RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")
SCORE_PATHS = ("/v1/score", "/score")

_rerank_decoder = msgspec.json.Decoder(RerankRequest)
_score_decoder = msgspec.json.Decoder(ScoreRequest)
_json = msgspec.json.Encoder()


class ScoreEndpoints:
    """The handlers of the rerank and score routes; one per frontend, safe for concurrent
    use."""

    def __init__(self, registry: ModelRegistry, embedder: Embedder) -> None:
        self.registry, self.embedder = registry, embedder

    async def rerank(self, http: HttpRequest, response: HttpResponse) -> None:
        req = _decode(_rerank_decoder, http.body)
        texts, params = validate_rerank(req)
        request_id = f"rerank-{req.request_id or uuid.uuid4().hex}"
        model, matrix, num_tokens = await self._similarities(
            http, req, texts, params, 1, request_id
        )
        scores = cosines(matrix[:1], matrix[1:])
        body = rerank_response(req, request_id, model.name, texts[1:], scores, num_tokens)
        await response.send(200, _json.encode(body))

    async def score(self, http: HttpRequest, response: HttpResponse) -> None:
        req = _decode(_score_decoder, http.body)
        pairs = validate_score(req)
        request_id = f"score-{req.request_id or uuid.uuid4().hex}"
        texts, num_firsts = [*pairs.firsts, *pairs.seconds], len(pairs.firsts)
        model, matrix, num_tokens = await self._similarities(
            http, req, texts, pairs.params(), num_firsts, request_id
        )
        scores = cosines(matrix[:num_firsts], matrix[num_firsts:])
        body = score_response(request_id, model.name, scores, num_tokens)
        await response.send(200, _json.encode(body))

    async def _similarities(
        self,
        http: HttpRequest,
        req: RerankRequest | ScoreRequest,
        texts: list[str],
        params: list[str],
        num_firsts: int,
        request_id: str,
    ) -> tuple[ServedModel, np.ndarray, int]:
        """The model, the unit vectors of `texts` (one row each; the first `num_firsts` are
        queries, the rest documents) and the number of tokens embedded."""
        route = http.path
        model = self.registry.get(req.model)
        model.require_task("embed", route)
        count_as(model.name, stream=False)
        embedder = self.embedder
        with (
            embedder.pipeline.admission.slots(1),  # one engine call, however many texts
            embedder.accounted(http, model.name, request_id) as tally,
        ):
            await model.ready()
            card = model.require_task("embed", route)  # instances may change
            inputs = embedder.token_ids(model, texts, params)
            inputs = cut_inputs(inputs, num_firsts, card.context_length, req)
            embedder.check(model, card, inputs, params, total_param=_total_param(params))
            result = await embedder.embed(http, model, inputs, request_id)
            tally.num_tokens = result.num_tokens
        return model, vectors(result), result.num_tokens


def cut_inputs(
    inputs: list[list[int]],
    num_firsts: int,
    context_length: int,
    req: RerankRequest | ScoreRequest,
) -> list[list[int]]:
    """The cuts a request asks for, as vLLM makes them: `max_tokens_per_query` keeps each of
    the first `num_firsts` texts' first N tokens, `max_tokens_per_doc` each later text's (0:
    uncut); then `truncate_prompt_tokens` keeps every text's last N tokens (`truncation_side`
    left, the default) or its first N (right); -1 is the context length."""
    firsts, seconds = inputs[:num_firsts], inputs[num_firsts:]
    if req.max_tokens_per_query:
        firsts = [ids[: req.max_tokens_per_query] for ids in firsts]
    if req.max_tokens_per_doc:
        seconds = [ids[: req.max_tokens_per_doc] for ids in seconds]
    inputs = firsts + seconds
    if req.truncate_prompt_tokens is not None:
        n = context_length if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
        right = req.truncation_side == "right"
        inputs = [ids[:n] if right else ids[-n:] for ids in inputs]
    return inputs


def cosines(firsts: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """The cosine similarity of each row of `seconds` with its row of `firsts` (a single row
    of `firsts` pairs with every one), clipped to [-1, 1] (rounding may put a unit vector's
    dot product with itself past 1)."""
    firsts = firsts / np.linalg.norm(firsts, axis=1, keepdims=True)
    seconds = seconds / np.linalg.norm(seconds, axis=1, keepdims=True)
    dots = np.einsum("ij,ij->i", np.broadcast_to(firsts, seconds.shape), seconds)
    clipped: np.ndarray = np.clip(dots, -1.0, 1.0)
    return clipped


def rerank_response(
    req: RerankRequest,
    request_id: str,
    model: str,
    documents: list[str],
    scores: np.ndarray,
    num_tokens: int,
) -> RerankResponse:
    """The documents best first (a stable sort: ties keep the earlier document first), the
    first `top_n` of them (0 or unset: all), with their text unless `return_documents` is
    false."""
    order = np.argsort(-scores, kind="stable")
    if req.top_n:
        order = order[: req.top_n]
    results = [
        RerankResult(
            index=int(i),
            relevance_score=float(scores[i]),
            document=RerankDocument(text=documents[i]) if req.return_documents else None,
        )
        for i in order
    ]
    usage = RerankUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
    return RerankResponse(id=request_id, model=model, usage=usage, results=results)


def score_response(
    request_id: str, model: str, scores: np.ndarray, num_tokens: int
) -> ScoreResponse:
    """One score per pair, in pair order."""
    return ScoreResponse(
        id=request_id,
        created=int(time.time()),
        model=model,
        data=[ScoreData(index=i, score=float(x)) for i, x in enumerate(scores)],
        usage=ScoreUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
    )


def _total_param(params: Sequence[str]) -> str:
    """The field named when the texts have too many tokens in all: the last input's field."""
    return params[-1].partition("[")[0]


def _decode(decoder: msgspec.json.Decoder[_Request], body: bytes) -> _Request:
    try:
        return decoder.decode(body)
    except http_errors.BODY_ERRORS as exc:
        raise http_errors.decode_error(exc, body) from exc
