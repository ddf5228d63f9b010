"""StructuredOutput → an llguidance grammar (text), shared by the frontend (validates a
request's schema up front) and the native engine (enforces it). No torch here.

JSON is compiled compact (no free whitespace): a small model given optional whitespace can
spend its whole budget on newlines. `strict` json_schema closes every object that names its
properties (`additionalProperties: false` where the schema left it open).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from tandem.errors import InvalidRequest
from tandem.protocols.engine import StructuredOutput

KINDS = ("grammar", "json", "json_schema", "regex")
_COMPACT: Any = {"whitespace_flexible": False}


def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar for `structured`. Raises InvalidRequest on a bad spec (one
    that does not parse; `validate` also checks what only compiling finds)."""
    kind, spec = structured.kind, structured.spec
    if kind not in KINDS:
        raise InvalidRequest(
            f"unknown structured output kind '{kind}'; expected one of: {', '.join(KINDS)}"
        )
    if kind == "json":
        return str(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, _COMPACT))
    if spec is None:
        raise InvalidRequest(f"structured output kind '{kind}' needs a spec; got none")
    try:
        if kind == "json_schema":
            return str(llguidance.LLMatcher.grammar_from_json_schema(_schema(structured), _COMPACT))
        if kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(spec))
        return str(llguidance.LLMatcher.grammar_from_lark(spec))
    except ValueError as exc:
        raise InvalidRequest(f"structured output {kind} does not compile: {exc}") from exc


def validate(structured: StructuredOutput) -> None:
    """Raise InvalidRequest (its message from the grammar compiler) unless `structured`
    compiles. About a millisecond for a typical schema; needs no vocabulary."""
    error = llguidance.LLMatcher.validate_grammar(grammar_text(structured))
    if error:
        raise InvalidRequest(f"structured output {structured.kind} does not compile: {error}")


def _schema(structured: StructuredOutput) -> Any:
    assert structured.spec is not None
    try:
        schema = json.loads(structured.spec)
    except ValueError as exc:
        raise InvalidRequest(f"json_schema spec is not JSON: {exc}") from exc
    if not isinstance(schema, dict | bool):
        raise InvalidRequest(f"json_schema must be an object; got {type(schema).__name__}")
    return closed_objects(schema) if structured.strict else schema


def closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that names its
    properties and leaves extras open (strict mode: only the named properties appear)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
