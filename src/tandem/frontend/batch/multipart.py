"""`multipart/form-data` bodies (RFC 7578), as `POST /v1/files` receives them from the OpenAI
SDKs: named fields, one of which may be a file."""

from __future__ import annotations

from typing import NamedTuple

from tandem.errors import InvalidRequest

MAX_PARTS = 16


class Part(NamedTuple):
    name: str
    filename: str | None
    data: bytes


def parse_form(content_type: str, body: bytes) -> dict[str, Part]:
    """The parts of a form by field name (the first of a repeated name); InvalidRequest for
    another content type, a missing boundary or a malformed body."""
    kind, _, params = content_type.partition(";")
    if kind.strip().lower() != "multipart/form-data":
        raise InvalidRequest(
            f"content-type {content_type[:60]!r}; expected multipart/form-data with a 'file' "
            "and a 'purpose' field (as the OpenAI SDKs send)",
            param="content-type",
        )
    boundary = _param(params, "boundary")
    if not boundary:
        raise InvalidRequest("multipart/form-data without a boundary", param="content-type")
    delimiter = b"--" + boundary.encode("latin-1")
    chunks = body.split(delimiter)
    if len(chunks) < 3 or not chunks[-1].startswith(b"--"):
        raise InvalidRequest("multipart body is malformed: its closing boundary is missing")
    parts: dict[str, Part] = {}
    for chunk in chunks[1:-1][:MAX_PARTS]:
        head, sep, data = chunk.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        if not sep:
            raise InvalidRequest("multipart body is malformed: a part has no header end")
        part = _part(head.decode("latin-1"), data.removesuffix(b"\r\n"))
        parts.setdefault(part.name, part)
    return parts


def _part(head: str, data: bytes) -> Part:
    for line in head.split("\r\n"):
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-disposition":
            field = _param(value.partition(";")[2], "name")
            if field is None:
                break
            filename = _param(value.partition(";")[2], "filename")
            return Part(field, filename, data)
    raise InvalidRequest("multipart body is malformed: a part has no content-disposition name")


def _param(params: str, key: str) -> str | None:
    for item in params.split(";"):
        name, eq, value = item.strip().partition("=")
        if eq and name.strip().lower() == key:
            value = value.strip()
            return value[1:-1] if len(value) >= 2 and value[0] == value[-1] == '"' else value
    return None
