"""Chat image parts → one placeholder per image → expanded rows + MmItems (preprocess_chat)."""

from __future__ import annotations

import pytest
from tests.support.images import data_url, synthetic_png

from tandem.errors import InvalidRequest
from tandem.frontend.models import ServedModel
from tandem.frontend.pipeline.preprocess import preprocess_chat, preprocess_completion
from tandem.multimodal.config import ImageConfig
from tandem.multimodal.image import decode_image
from tandem.multimodal.loader import ImageLoader
from tandem.protocols.discovery import ModelCard
from tandem.protocols.openai import ChatCompletionRequest, CompletionRequest
from tandem.router.source import StaticInstanceSet
from tandem.tokens.chat_template import ChatTemplate

PH, N = 16, 5  # SmolLM2's <empty_output>; rows per image


def _model(smollm2, *, images: bool = True) -> ServedModel:
    card = ModelCard(
        name="m",
        context_length=256,
        block_size=16,
        num_total_blocks=64,
        mm_num_tokens_per_image=N if images else 0,
        mm_placeholder_token_id=PH if images else None,
    )
    served = ServedModel(card, router=None, instances=StaticInstanceSet())  # type: ignore[arg-type]
    served.tokenizer = smollm2
    served.chat_template = ChatTemplate(smollm2.chat_template)
    return served


def _image(seed: int) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(synthetic_png(seed=seed))}}


async def _pre(model: ServedModel, messages: list[dict], **config: object):
    req = ChatCompletionRequest(model="m", messages=messages, n=2)
    loader = ImageLoader(ImageConfig(**config))  # type: ignore[arg-type]
    return await preprocess_chat(
        req, model, request_id="r", worker_id=None, deadline_s=None, images=loader
    )


async def test_each_image_expands_to_its_rows_with_an_item(smollm2) -> None:
    model = _model(smollm2)
    content = [_image(1), {"type": "text", "text": "and"}, _image(2), {"type": "text", "text": "?"}]
    p = await _pre(model, [{"role": "user", "content": content}])
    text = model.chat_template.render(  # type: ignore[union-attr]
        [{"role": "user", "content": "Picture: <empty_output>\nandPicture: <empty_output>\n?"}]
    )
    base = smollm2.encode(text, add_special_tokens=False)
    for r in p.requests:  # every choice carries the images
        items = r.mm_items
        assert [i.num_tokens for i in items] == [N, N]
        assert [i.mm_hash for i in items] == [
            decode_image(synthetic_png(seed=s)).mm_hash for s in (1, 2)
        ]
        assert items[0].image_bytes == synthetic_png(seed=1)
        assert len(r.token_ids) == len(base) + 2 * (N - 1)
        for item in items:
            assert r.token_ids[item.offset : item.offset + N] == [PH] * N
        assert r.token_ids.count(PH) == 2 * N
        first = base.index(PH)
        assert r.token_ids[:first] == base[:first] and items[0].offset == first
    assert p.prompt_lens == [len(p.requests[0].token_ids)]


async def test_text_only_model_refuses_images(smollm2) -> None:
    with pytest.raises(InvalidRequest, match=r"messages\[0\].content\[1\]: model 'm' does not"):
        await _pre(_model(smollm2, images=False), [{"role": "user", "content": [
            {"type": "text", "text": "hi"}, _image(1)]}])  # fmt: skip


async def test_too_many_images_names_the_first_part_over_the_limit(smollm2) -> None:
    messages = [
        {"role": "user", "content": [_image(1), _image(2)]},
        {"role": "user", "content": [{"type": "text", "text": "x"}, _image(3)]},
    ]
    with pytest.raises(InvalidRequest, match="the request has 3 images; the limit is 2") as info:
        await _pre(_model(smollm2), messages, max_images_per_request=2)
    assert info.value.param == "messages[1].content[1]"


async def test_placeholder_text_typed_by_the_user_is_refused(smollm2) -> None:
    content = [_image(1), {"type": "text", "text": "what is <empty_output>?"}]
    with pytest.raises(InvalidRequest, match=r"2 image placeholder tokens .* for 1 images"):
        await _pre(_model(smollm2), [{"role": "user", "content": content}])


async def test_malformed_image_part_is_refused(smollm2) -> None:
    content = [{"type": "image_url", "image_url": "data:image/png;base64,AAAA"}]
    with pytest.raises(InvalidRequest, match=r"content\[0\].image_url must be an object"):
        await _pre(_model(smollm2), [{"role": "user", "content": content}])


async def test_bad_image_fails_the_request_naming_the_part(smollm2) -> None:
    content = [_image(1), {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]
    with pytest.raises(InvalidRequest, match="not valid base64") as info:
        await _pre(_model(smollm2), [{"role": "user", "content": content}])
    assert info.value.param == "messages[0].content[1]"


async def test_context_length_counts_the_expanded_rows(smollm2) -> None:
    model = _model(smollm2)
    model.card.context_length = 50 + 2 * N  # fits the text, not the rows
    with pytest.raises(InvalidRequest, match=r"prompt has .* tokens; model context is"):
        await _pre(model, [{"role": "user", "content": [_image(i) for i in range(8)]}])


async def test_completions_refuse_image_parts(smollm2) -> None:
    req = CompletionRequest(model="m", prompt=["hi", _image(1)])
    with pytest.raises(InvalidRequest, match=r"prompt\[1\] is a 'image_url' content part"):
        await preprocess_completion(
            req, _model(smollm2), request_id="r", worker_id=None, deadline_s=None
        )
