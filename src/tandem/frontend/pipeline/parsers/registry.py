"""Parsers by name, and the names a chat template makes certain.

The names are `tandem.protocols.discovery.TOOL_CALL_PARSERS` / `REASONING_PARSERS` (a worker
checks its `--tool-call-parser` / `--reasoning-parser` against them and puts them in its
ModelCard); the classes are here. Without a flag, the chat template decides where it is
unambiguous (`detect_tool_parser`, `detect_reasoning_parser`), else today's default: Hermes
and no reasoning parser.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.frontend.pipeline.parsers.base import ToolParser
from tandem.frontend.pipeline.parsers.hermes import HermesToolParser
from tandem.frontend.pipeline.parsers.llama3_json import PYTHON_TAG, Llama3JsonToolParser
from tandem.frontend.pipeline.parsers.mistral import TOOL_CALLS, MistralToolParser
from tandem.frontend.pipeline.parsers.pythonic import PythonicToolParser
from tandem.frontend.pipeline.parsers.qwen3_coder import Qwen3CoderToolParser
from tandem.frontend.pipeline.parsers.reasoning import THINK, ReasoningParser
from tandem.protocols.discovery import REASONING_PARSERS, TOOL_CALL_PARSERS

DEFAULT_TOOL_PARSER = "hermes"

_TOOL_PARSERS: dict[str, type[Any]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
}
assert tuple(sorted(_TOOL_PARSERS)) == TOOL_CALL_PARSERS
assert REASONING_PARSERS == ("deepseek_r1", "qwen3")


def make_tool_parser(
    name: str, *, max_calls: int | None = None, tools: Sequence[Any] = ()
) -> ToolParser:
    """A parser of format `name` for one choice (`tools`: the offered `tools.Tool`s, whose
    schemas type Qwen3-Coder's parameters); ValueError naming the known ones."""
    cls = _TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(
            f"unknown tool call parser '{name}'; expected one of: {', '.join(TOOL_CALL_PARSERS)}"
        )
    parser: ToolParser = cls(max_calls=max_calls, tools=tools)
    return parser


def needs_special_tokens(name: str) -> bool:
    """Whether format `name` opens its calls with a special token (which a text decoded
    without special tokens would lose)."""
    return bool(getattr(_TOOL_PARSERS.get(name), "needs_special_tokens", False))


def make_reasoning_parser(name: str, *, prompt_opens_think: bool) -> ReasoningParser:
    """A reasoning parser of style `name` for one choice; ValueError naming the known ones."""
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser '{name}'; expected one of: {', '.join(REASONING_PARSERS)}"
        )
    return ReasoningParser(in_reasoning=name == "deepseek_r1" or prompt_opens_think)


def detect_tool_parser(template: str | None) -> str | None:
    """The format a chat template's markup makes certain, or None."""
    if not template:
        return None
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"  # before <tool_call>: its template writes that too
    if TOOL_CALLS in template:
        return "mistral"
    if PYTHON_TAG in template:
        return "llama3_json"
    if "<tool_call>" in template:
        return "hermes"
    return None


def detect_reasoning_parser(template: str | None) -> str | None:
    """`qwen3` (reasoning where the output or the prompt opens it) for a template that
    writes `<think>`; None otherwise."""
    return "qwen3" if template and THINK in template else None
