"""`/tokenize` (frontend/api/model_routes.py) decodes its tokens back to strings only when asked
(`return_token_strs`, vLLM's flag): a decode per token is most of its cost, and a router that
calls it per request (to route by tokens) does not read them."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import msgspec

from tandem.frontend.api.model_routes import tokenize


@dataclass
class CountingTokenizer:
    """One id per word; counts decode calls."""

    num_decodes: int = 0

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        self.num_decodes += 1
        return "x" * ids[0]


@dataclass
class FakeModel:
    tok: CountingTokenizer = field(default_factory=CountingTokenizer)
    name: str = "m"
    card: Any = field(default_factory=lambda: SimpleNamespace(context_length=64))

    async def ready(self) -> None:
        pass

    def require_tokenizer(self, endpoint: str) -> CountingTokenizer:
        return self.tok


class FakeRegistry:
    def __init__(self, model: FakeModel) -> None:
        self.model = model

    def live(self) -> list[FakeModel]:
        return [self.model]

    def get(self, name: str) -> FakeModel:
        return self.model


async def test_token_strings_are_decoded_only_when_asked() -> None:
    model = FakeModel()
    registry: Any = FakeRegistry(model)
    body = {"prompt": "one three five words here"}
    plain = msgspec.json.decode(await tokenize(registry, msgspec.json.encode(body)))
    assert plain["tokens"] == [3, 5, 4, 5, 4] and plain.get("token_strs") is None
    assert model.tok.num_decodes == 0  # no string made per token
    asked = {**body, "return_token_strs": True}
    strs = msgspec.json.decode(await tokenize(registry, msgspec.json.encode(asked)))
    assert strs["token_strs"] == ["xxx", "xxxxx", "xxxx", "xxxxx", "xxxx"]
    assert model.tok.num_decodes == 5
