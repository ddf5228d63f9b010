"""Chat image parts → placeholder tokens → expanded prompt + `MmItem`s (DESIGN.md §10, step 1).

Each `{"type": "image_url", "image_url": {"url": ...}}` part becomes the text frame
`IMAGE_FRAME` around the model's placeholder token, so the chat template renders one placeholder
per image; after tokenizing, each placeholder is expanded to the encoder's `num_tokens_per_image`
rows (the placeholder id repeated), which the engine replaces by the image's embedding rows. The
frame matters for the classifier-bridge encoder: SmolLM2 names the object when the rows follow
"Picture:" and come before the question.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from tandem.errors import InvalidRequest
from tandem.multimodal.image import DecodedImage
from tandem.multimodal.loader import ImageLoader
from tandem.protocols.discovery import ModelCard
from tandem.protocols.engine import MmItem

IMAGE_FRAME = "Picture: {placeholder}\n"


@dataclass(frozen=True, slots=True)
class ImagePart:
    param: str  # "messages[i].content[j]"
    url: str


@dataclass(frozen=True, slots=True)
class PromptImages:
    """The decoded images of one chat request, in prompt order, and how they expand."""

    images: list[DecodedImage]
    placeholder_id: int
    num_tokens_per_image: int


def image_parts(messages: list[dict[str, Any]]) -> list[ImagePart]:
    """The image parts of `messages` in order. Raises InvalidRequest for a malformed one."""
    parts: list[ImagePart] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                param = f"messages[{i}].content[{j}]"
                spec = part.get("image_url")
                url = spec.get("url") if isinstance(spec, dict) else None
                if not isinstance(url, str) or not url:
                    raise InvalidRequest(
                        f"{param}.image_url must be an object with a non-empty 'url' string, "
                        f"got {spec!r:.80}",
                        param=f"{param}.image_url",
                    )
                parts.append(ImagePart(param, url))
    return parts


def with_placeholders(
    messages: list[dict[str, Any]], placeholder_text: str
) -> list[dict[str, Any]]:
    """`messages` with every image part replaced by a text part holding the image frame."""
    frame = {"type": "text", "text": IMAGE_FRAME.format(placeholder=placeholder_text)}
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [
                frame if isinstance(p, dict) and p.get("type") == "image_url" else p
                for p in content
            ]
            message = {**message, "content": content}
        out.append(message)
    return out


async def load_images(
    parts: list[ImagePart], *, card: ModelCard, loader: ImageLoader
) -> PromptImages:
    """Check the model takes images and the count limit, then load all parts concurrently.
    Raises InvalidRequest naming the first offending part."""
    first = parts[0].param
    if card.mm_num_tokens_per_image <= 0 or card.mm_placeholder_token_id is None:
        raise InvalidRequest(
            f"{first}: model '{card.name}' does not accept images (its workers run no vision "
            "encoder); send text only",
            param=first,
        )
    limit = loader.config.max_images_per_request
    if len(parts) > limit:
        bad = parts[limit].param
        raise InvalidRequest(
            f"{bad}: the request has {len(parts)} images; the limit is {limit} per request "
            "(--mm-max-images-per-request)",
            param=bad,
        )
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(loader.load(p.url, param=p.param)) for p in parts]
    except* InvalidRequest as group:
        raise group.exceptions[0] from None
    return PromptImages(
        images=[t.result() for t in tasks],
        placeholder_id=card.mm_placeholder_token_id,
        num_tokens_per_image=card.mm_num_tokens_per_image,
    )


def expand_placeholders(
    token_ids: list[int], images: PromptImages, *, param: str = "messages"
) -> tuple[list[int], list[MmItem]]:
    """Repeat each placeholder token `num_tokens_per_image` times; one MmItem per image (with
    its original bytes, so the worker can decode it). Raises InvalidRequest when the prompt holds
    another number of placeholders than images (the placeholder's text typed in a message)."""
    positions = [i for i, t in enumerate(token_ids) if t == images.placeholder_id]
    if len(positions) != len(images.images):
        raise InvalidRequest(
            f"the prompt holds {len(positions)} image placeholder tokens (id "
            f"{images.placeholder_id}) for {len(images.images)} images; the placeholder's text "
            "is reserved for image parts, remove it from the message text",
            param=param,
        )
    n = images.num_tokens_per_image
    out: list[int] = []
    items: list[MmItem] = []
    prev = 0
    for pos, image in zip(positions, images.images, strict=True):
        out += token_ids[prev:pos]
        items.append(
            MmItem(
                mm_hash=image.mm_hash, offset=len(out), num_tokens=n, image_bytes=image.source_bytes
            )
        )
        out += [images.placeholder_id] * n
        prev = pos + 1
    out += token_ids[prev:]
    return out, items
