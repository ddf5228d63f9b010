"""`response_format` → the engine's StructuredOutput, validated before anything is routed.

    {"type": "text"}                                   no constraint
    {"type": "json_object"}                            any JSON object
    {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}

The schema is compiled here with the grammar compiler the native engine enforces it with
(tandem.tokens.grammar), so a schema the engine could not enforce is a 400 naming
`response_format.json_schema.schema`, never a 200 with unconstrained text.
"""

from __future__ import annotations

import json
import re
from typing import Any, NoReturn

from tandem.errors import InvalidRequest
from tandem.protocols.engine import StructuredOutput
from tandem.protocols.openai import show_value
from tandem.tokens import grammar

FORMAT_TYPES = ("json_object", "json_schema", "text")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_SCHEMA_BYTES = 1 << 20  # compiled per request: bounded like every client input


def response_format_output(value: Any) -> StructuredOutput | None:
    """The constraint `response_format` asks for (None for text or unset). Raises
    InvalidRequest naming the offending field."""
    if value is None:
        return None
    param = "response_format"
    if not isinstance(value, dict):
        _bad(param, value, "an object such as {'type': 'json_object'}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(kind="json")
    if kind != "json_schema":
        _bad(f"{param}.type", kind, f"one of: {', '.join(FORMAT_TYPES)}")
    spec = value.get("json_schema")
    param += ".json_schema"
    if not isinstance(spec, dict):
        _bad(param, spec, "an object with 'name' and 'schema'")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        _bad(f"{param}.name", name, "a name of 1-64 letters, digits, '_' or '-'")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        _bad(f"{param}.strict", strict, "true, false or unset")
    schema = spec.get("schema", {})  # OpenAI: an absent schema means any JSON object
    return schema_output(schema, f"{param}.schema", strict=bool(strict))


def schema_output(schema: Any, param: str, *, strict: bool) -> StructuredOutput:
    """A json_schema constraint for `schema`, compiled once here; raises InvalidRequest
    (param = `param`) when it does not compile."""
    if not isinstance(schema, dict):
        _bad(param, schema, "a JSON Schema object")
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_BYTES:
        raise InvalidRequest(
            f"{param} has {len(text)} bytes; at most {MAX_SCHEMA_BYTES} are accepted", param=param
        )
    out = StructuredOutput(kind="json_schema", spec=text, strict=strict)
    try:
        grammar.validate(out)
    except InvalidRequest as exc:
        message = f"{param} is not a usable JSON Schema: {exc.message}"
        raise InvalidRequest(message, param=param) from exc
    return out


def _bad(param: str, value: Any, expected: str) -> NoReturn:
    raise InvalidRequest(
        f"{param}={show_value(value)} is invalid; expected {expected}", param=param
    )
