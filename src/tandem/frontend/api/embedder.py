"""Inputs → token ids → one routed call to a worker's `embed` endpoint: what every endpoint
built on embeddings shares (`/v1/embeddings`, `/v1/rerank`, `/v1/score`).

1. `token_ids`: text inputs tokenized (special tokens as `/v1/completions` adds them).
2. `check`: each input's ids against the vocabulary and the card's context length, the
   request's total tokens (400 naming the input, or the field given for the total).
3. `embed`: the model's router picks a worker among those that embed (load accounted like a
   prompt of all the inputs' tokens, with the policy's own cost: a KV router still credits
   prefix overlap, which embeddings do not use); the whole batch goes in one `EmbedRequest`.
   A worker that refuses or is lost before answering costs a retry on another one (bounded by
   the number of instances).
4. `accounted`: the request's span, log scope and metrics (an embedding has no first token:
   it leaves the queued gauge when done; the planner sees a prompt and no output).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from tandem.errors import ContextLengthExceeded, InvalidRequest, NoWorkersAvailable, PeerGone
from tandem.frontend.http.message import ClientDisconnected
from tandem.frontend.http.server import HttpRequest
from tandem.frontend.models import ServedModel
from tandem.frontend.pipeline.generate import PIN_HEADER, GeneratePipeline, request_context
from tandem.protocols.discovery import ModelCard
from tandem.protocols.embedding import (
    EMBED_ENDPOINT,
    EmbedRequest,
    EmbedResponse,
    decode_embed_response,
    encode,
)
from tandem.protocols.engine import PreprocessedRequest, RoutingHints, StopConditions
from tandem.protocols.openai_embedding import MAX_TOTAL_TOKENS
from tandem.runtime.base import RequestClient

logger = logging.getLogger(__name__)


class EmbedTally:
    """What an accounted request reports once it has its answer."""

    __slots__ = ("num_tokens",)

    def __init__(self) -> None:
        self.num_tokens = 0


class Embedder:
    """The embed calls of one frontend; safe for concurrent use."""

    def __init__(self, pipeline: GeneratePipeline, client: RequestClient | None) -> None:
        self.pipeline = pipeline
        self._client = client

    @contextmanager
    def accounted(self, http: HttpRequest, model: str, request_id: str) -> Iterator[EmbedTally]:
        """The request's root span and log scope, and its metrics: arrived now, left when the
        block ends (failed unless it ended normally), its tokens (set on the tally) counted
        as a prompt."""
        metrics = self.pipeline.metrics
        metrics.arrived(model)
        started, failed = time.perf_counter(), True
        tally = EmbedTally()
        try:
            with request_context(http, request_id, model):
                yield tally
            failed = False
            metrics.input_len.labels(model).observe(tally.num_tokens)
            metrics.input_tokens.labels(model).inc(tally.num_tokens)
            if metrics.interval is not None:  # the planner's view: a prompt, no output
                metrics.interval.finished(model, isl=tally.num_tokens, osl=0)
        except (asyncio.CancelledError, ClientDisconnected):
            metrics.disconnects.labels(model).inc()
            raise
        finally:
            # no first token: an embedding leaves the queued gauge when it is done
            seconds = time.perf_counter() - started
            metrics.left(model, seconds, had_first_token=False, failed=failed)

    @staticmethod
    def token_ids(
        model: ServedModel, texts: Sequence[str | list[int]], params: Sequence[str]
    ) -> list[list[int]]:
        """Each input's token ids (token-id inputs as they are); raises InvalidRequest naming
        an input that tokenizes to nothing."""
        return [_token_ids(model, t, p) for t, p in zip(texts, params, strict=True)]

    @staticmethod
    def check(
        model: ServedModel,
        card: ModelCard,
        inputs: list[list[int]],
        params: Sequence[str],
        *,
        total_param: str,
    ) -> None:
        """Raise InvalidRequest (ContextLengthExceeded) naming the input whose ids are out of
        the vocabulary or longer than the context, or `total_param` when all of them together
        exceed MAX_TOTAL_TOKENS."""
        vocab = model.tokenizer.vocab_size if model.tokenizer is not None else None
        total = 0
        for ids, param in zip(inputs, params, strict=True):
            for t in ids:
                if t < 0 or (vocab is not None and t >= vocab):
                    raise InvalidRequest(
                        f"{param} has token id {t} out of range; expected "
                        f"[0, {vocab or 'vocab size'})",
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
                f"{total_param} has {total} tokens in all; at most {MAX_TOTAL_TOKENS} per "
                "request (split it)",
                param=total_param,
            )

    async def embed(
        self, http: HttpRequest, model: ServedModel, inputs: list[list[int]], request_id: str
    ) -> EmbedResponse:
        """One vector per input, from one worker that embeds (checked inputs only)."""
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
                model.router.on_finish(request_id, 0)  # an embedding generates no token
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


def vectors(result: EmbedResponse) -> np.ndarray:
    """The answer's [num_inputs, dim] float32 matrix of unit vectors (read-only view)."""
    return np.frombuffer(result.data, dtype="<f4").reshape(-1, result.dim)


def _token_ids(model: ServedModel, text: str | list[int], param: str) -> list[int]:
    if not isinstance(text, str):
        return text
    tok = model.require_tokenizer("a text input")
    ids = list(tok.encode(text, add_special_tokens=True))
    if not ids:
        raise InvalidRequest(f"{param} has no tokens; expected text to embed", param=param)
    return ids
