"""`POST /v1/embeddings`: inputs → token ids → one routed call to a worker's `embed` endpoint.

1. Decode and check the request (`protocols/openai_embedding.py`); the model must have a
   worker that embeds (its card lists the "embed" task), else 400 naming the model.
2. Take one admission slot (the frontend's in-flight bound, 503 + Retry-After past it).
3. Tokenize text inputs; check each input's token ids (vocabulary) and length (context),
   the request's total tokens, and `dimensions` (400 naming `input[i]` or the field).
4. The model's router picks a worker among those that embed (load accounted like a prompt of
   all the inputs' tokens, with the policy's own cost: a KV router still credits prefix overlap,
   which embeddings do not use); the whole batch goes in one `EmbedRequest`. A worker that
   refuses or is lost before answering costs a retry on another one (bounded by the number of
   instances).
5. Vectors come back as one float32 matrix; `dimensions` keeps a prefix and renormalises (only
   on models whose card declares Matryoshka training, as OpenAI refuses `dimensions` for
   text-embedding-ada-002); `encoding_format` float (JSON numbers) or base64 (the vector's
   little-endian float32 bytes, as OpenAI sends them).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from typing import Any

import msgspec
import numpy as np

from tandem.errors import ContextLengthExceeded, InvalidRequest, NoWorkersAvailable, PeerGone
from tandem.frontend import errors as http_errors
from tandem.frontend.http.message import ClientDisconnected
from tandem.frontend.http.server import HttpRequest, HttpResponse
from tandem.frontend.models import ModelRegistry, ServedModel
from tandem.frontend.observability.metrics import count_as
from tandem.frontend.pipeline.generate import PIN_HEADER, GeneratePipeline, server_span
from tandem.protocols.discovery import ModelCard
from tandem.protocols.embedding import (
    EMBED_ENDPOINT,
    EmbedRequest,
    EmbedResponse,
    decode_embed_response,
    encode,
)
from tandem.protocols.engine import PreprocessedRequest, RoutingHints, StopConditions
from tandem.protocols.openai_embedding import (
    MAX_TOTAL_TOKENS,
    EmbeddingRequest,
    embedding_inputs,
    validate_embedding,
)
from tandem.runtime.base import RequestClient
from tandem.runtime.log_format import request_scope

logger = logging.getLogger(__name__)

_decoder = msgspec.json.Decoder(EmbeddingRequest)
_json = msgspec.json.Encoder()


class EmbeddingsEndpoint:
    """The handler of `POST /v1/embeddings`; one per frontend, safe for concurrent use."""

    def __init__(
        self, registry: ModelRegistry, pipeline: GeneratePipeline, client: RequestClient | None
    ) -> None:
        self.registry, self.pipeline = registry, pipeline
        self._client = client

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
        with self.pipeline.admission.slots(1):  # one engine call, however many inputs
            await self._serve(http, response, req, texts, params, model)

    async def _serve(
        self,
        http: HttpRequest,
        response: HttpResponse,
        req: EmbeddingRequest,
        texts: list[str | list[int]],
        params: list[str],
        model: ServedModel,
    ) -> None:
        metrics = self.pipeline.metrics
        metrics.arrived(model.name)
        started, failed = time.perf_counter(), True
        request_id = f"embd-{uuid.uuid4().hex}"
        try:
            with request_scope(request_id), server_span(http, request_id, model.name):
                await model.ready()
                card = model.require_task("embed", "/v1/embeddings")  # instances may change
                dim = _dimensions(req, card, model.name)
                inputs = [await _token_ids(model, t, p) for t, p in zip(texts, params, strict=True)]
                _check_inputs(model, card, inputs, params)
                result = await self._embed(http, model, inputs, request_id)
                body = _body(req, model.name, result, dim)
                await response.send(200, body)
            failed = False
            metrics.input_len.labels(model.name).observe(result.num_tokens)
            metrics.input_tokens.labels(model.name).inc(result.num_tokens)
            if metrics.interval is not None:  # the planner's view: a prompt, no output
                metrics.interval.finished(model.name, isl=result.num_tokens, osl=0)
        except (asyncio.CancelledError, ClientDisconnected):
            metrics.disconnects.labels(model.name).inc()
            raise
        finally:
            # no first token: an embedding leaves the queued gauge when it is done
            seconds = time.perf_counter() - started
            metrics.left(model.name, seconds, had_first_token=False, failed=failed)

    async def _embed(
        self, http: HttpRequest, model: ServedModel, inputs: list[list[int]], request_id: str
    ) -> EmbedResponse:
        if self._client is None:
            raise NoWorkersAvailable("this frontend has no request-plane client for embeddings")
        deadline_s = self.pipeline.deadline_s()
        pin = http.headers.get(PIN_HEADER)
        # the router sees one prompt of every input's tokens: its load is what it costs
        route_request = PreprocessedRequest(
            request_id=request_id,
            model=model.name,
            token_ids=[t for ids in inputs for t in ids],
            stop=StopConditions(max_tokens=1),
            routing=RoutingHints(worker_id=pin) if pin else None,
            deadline_s=deadline_s,
        )
        payload = encode(
            EmbedRequest(
                request_id=request_id, model=model.name, inputs=inputs, deadline_s=deadline_s
            )
        )
        excluded = {
            iid
            for iid, inst in model.instances.instances.items()
            if inst.model is None or "embed" not in inst.model.tasks
        }
        for _ in range(len(model.instances.instances) + 1):
            decision = await model.router.route(route_request, exclude=frozenset(excluded))
            instance = model.instances.instances.get(decision.instance_id)
            endpoint = instance.metadata.get("embed_endpoint", EMBED_ENDPOINT) if instance else ""
            path = f"{instance.namespace}.{instance.component}.{endpoint}" if instance else ""
            try:
                return await self._call(decision.address, path, payload, request_id, deadline_s)
            except PeerGone as exc:
                logger.info(
                    "request_id=%s not served by worker %s (%s); routing it again",
                    request_id,
                    decision.instance_id,
                    exc,
                )
                excluded.add(decision.instance_id)
            finally:
                model.router.on_finish(request_id)
        raise NoWorkersAvailable(f"no worker of model '{model.name}' answered the embeddings")

    async def _call(
        self, address: str, path: str, payload: bytes, request_id: str, deadline_s: float
    ) -> EmbedResponse:
        assert self._client is not None
        if not path:
            raise PeerGone("the routed instance left discovery")
        stream = self._client.stream(
            address, path, payload, request_id=request_id, deadline_s=deadline_s
        )
        try:
            answer = await anext(aiter(stream), None)
        finally:
            await stream.aclose()
        if answer is None:
            raise PeerGone(f"embed stream from {address} ended without an answer")
        return decode_embed_response(answer)


async def _token_ids(model: ServedModel, text: str | list[int], param: str) -> list[int]:
    if not isinstance(text, str):
        return text
    tok = model.require_tokenizer("a text input")
    ids = list(tok.encode(text, add_special_tokens=True))
    if not ids:
        raise InvalidRequest(f"{param} has no tokens; expected text to embed", param=param)
    return ids


def _check_inputs(
    model: ServedModel, card: ModelCard, inputs: list[list[int]], params: list[str]
) -> None:
    vocab = model.tokenizer.vocab_size if model.tokenizer is not None else None
    total = 0
    for ids, param in zip(inputs, params, strict=True):
        for t in ids:
            if t < 0 or (vocab is not None and t >= vocab):
                raise InvalidRequest(
                    f"{param} has token id {t} out of range; expected [0, {vocab or 'vocab size'})",
                    param=param,
                )
        if len(ids) > card.context_length:
            raise ContextLengthExceeded(
                f"{param} has {len(ids)} tokens; model '{model.name}' takes at most "
                f"{card.context_length} per input (shorten or split it)",
                param=param,
            )
        total += len(ids)
    if total > MAX_TOTAL_TOKENS:
        raise InvalidRequest(
            f"input has {total} tokens in all; at most {MAX_TOTAL_TOKENS} per request (split it)",
            param="input",
        )


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
    matrix = np.frombuffer(result.data, dtype="<f4").reshape(-1, result.dim)
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
