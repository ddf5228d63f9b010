"""The model and token routes: GET /v1/models/{id}, /tokenize and /detokenize (vLLM's
shapes)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from tandem.errors import InvalidRequest, ModelNotFound
from tandem.frontend.api.request_input import decode_body
from tandem.frontend.models import ModelRegistry, ServedModel
from tandem.multimodal.prompt import image_parts
from tandem.protocols.lora import LoraCard
from tandem.protocols.openai_types import (
    MAX_TOKENIZE_IDS,
    DetokenizeRequest,
    DetokenizeResponse,
    Model,
    TokenizeRequest,
    TokenizeResponse,
)

_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)
_json = msgspec.json.Encoder()
_THREAD_TOKENIZE_CHARS = 16_384


def adapter_entry(card: LoraCard) -> dict[str, Any]:
    """A LoRA adapter in /v1/models (vLLM's ModelCard of an adapter)."""
    return {"id": card.name, "object": "model", "created": int(card.created_s),
            "owned_by": "tandem", "root": card.path, "parent": card.base_model}  # fmt: skip


def served_model(registry: ModelRegistry, name: str) -> bytes:
    """GET /v1/models/{model}'s body; ModelNotFound (404) unless `name` has live workers
    (the models /v1/models lists) or is an adapter of such a model."""
    live = {m.name: m for m in registry.live()}
    if name not in live:
        for card in registry.live_adapters():
            if card.name == name:
                return _json.encode(adapter_entry(card))
        served = ", ".join(sorted(live)) or "none"
        raise ModelNotFound(
            f"model '{name}' does not exist; served models: {served}", param="model"
        )
    model = live[name]
    return _json.encode(Model(id=model.name, created=model.created, owned_by="tandem"))


async def model_for(registry: ModelRegistry, name: str | None) -> ServedModel:
    """The served model `name`, once ready; None names the one model served (vLLM's routes
    take no model), else InvalidRequest listing them."""
    if name is None:
        live = registry.live()
        if len(live) != 1:
            served = ", ".join(sorted(m.name for m in live)) or "none"
            raise InvalidRequest(f"model is required; served models: {served}", param="model")
        name = live[0].name
    model = registry.get(name)
    await model.ready()
    return model


async def tokenize(registry: ModelRegistry, body: bytes) -> bytes:
    """POST /tokenize: the token ids of a prompt, or of messages rendered by the model's
    chat template (what /v1/chat/completions would send to the engine for text messages)."""
    req = decode_body(_tokenize_decoder, body)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequest("expected exactly one of prompt and messages", param="prompt")
    model = await model_for(registry, req.model)
    tok = model.require_tokenizer("/tokenize")
    if req.messages is not None:
        if image_parts(req.messages):
            raise InvalidRequest(
                "/tokenize takes text messages only; image parts expand to placeholder tokens "
                "only when /v1/chat/completions loads the image",
                param="messages",
            )
        assert model.chat_template is not None
        text = model.chat_template.render(
            req.messages,
            add_generation_prompt=req.add_generation_prompt,
            template_kwargs=req.chat_template_kwargs,
        )
        special = bool(req.add_special_tokens)
    else:
        assert req.prompt is not None
        text = req.prompt
        special = req.add_special_tokens is not False
    if len(text) > _THREAD_TOKENIZE_CHARS:  # long texts are tokenized off the event loop
        ids = await asyncio.to_thread(tok.encode, text, add_special_tokens=special)
    else:
        ids = tok.encode(text, add_special_tokens=special)
    strs = None
    if req.return_token_strs:  # a decode per token: only when asked (vLLM's flag)
        strs = [tok.decode([t], skip_special_tokens=False) for t in ids]
    return _json.encode(
        TokenizeResponse(
            count=len(ids),
            max_model_len=model.card.context_length,
            tokens=ids,
            token_strs=strs,
        )
    )


async def detokenize(registry: ModelRegistry, body: bytes) -> bytes:
    """POST /detokenize: the text of token ids (special tokens kept, as vLLM does)."""
    req = decode_body(_detokenize_decoder, body)
    model = await model_for(registry, req.model)
    tok = model.require_tokenizer("/detokenize")
    if len(req.tokens) > MAX_TOKENIZE_IDS:
        raise InvalidRequest(
            f"tokens has {len(req.tokens)} ids; expected at most {MAX_TOKENIZE_IDS}",
            param="tokens",
        )
    vocab = tok.vocab_size
    for i, t in enumerate(req.tokens):
        if not 0 <= t < vocab:
            raise InvalidRequest(
                f"tokens[{i}]={t} is out of range; expected a token id in [0, {vocab})",
                param=f"tokens[{i}]",
            )
    text = tok.decode(req.tokens, skip_special_tokens=False)
    return _json.encode(DetokenizeResponse(prompt=text))
