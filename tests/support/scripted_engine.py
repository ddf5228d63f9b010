"""`ScriptedEngine`: a mocker whose every answer is one fixed text, for tests of what the
frontend makes of a model's output (tool-call and reasoning parsers, API shapes)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.protocols.engine import EngineOutput, PreprocessedRequest, prompt_array
from tandem.tokens.tokenizer import load_tokenizer


class ScriptedEngine(MockerEngine):
    """A mocker whose every answer is one fixed text (its tokens, three per chunk); `prompts`
    records each request's prompt as text."""

    def __init__(self, text: str, *, eos: bool = False) -> None:
        super().__init__(MockerConfig(speedup_ratio=0))
        assert self.config.tokenizer is not None
        self.tok = load_tokenizer(self.config.tokenizer)
        self.ids = list(self.tok.encode(text, add_special_tokens=False))
        self.eos = eos  # end as a real model does: its EOS token, with the finish
        self.prompts: list[str] = []

    async def generate(  # type: ignore[override]
        self, request: PreprocessedRequest, **_: Any
    ) -> AsyncGenerator[EngineOutput, None]:
        self.prompts.append(self.tok.decode(prompt_array(request).tolist()))
        ids = self.ids[: request.stop.max_tokens or len(self.ids)]
        for i in range(0, len(ids), 3):
            yield EngineOutput(token_ids=ids[i : i + 3])
        if self.eos and len(ids) == len(self.ids):
            yield EngineOutput(token_ids=[self.tok.eos_token_ids[0]], finish_reason="stop")
            return
        yield EngineOutput(finish_reason="stop" if len(ids) == len(self.ids) else "length")
