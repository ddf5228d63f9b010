"""`/v1/files` (OpenAI's Files API, as the SDKs use it for batches): upload (multipart,
`purpose=batch`), list, retrieve, download the content, delete. A file belongs to the tenant
or API key that uploaded it (`frontend/ownership.py`): to anyone else its id is unknown (404).
The output and error files a batch writes are its owner's, `purpose: batch_output`."""

from __future__ import annotations

import asyncio
import secrets
import time
import urllib.parse
from typing import Any

import msgspec

from tandem.errors import InvalidRequest, ServingError
from tandem.frontend.batch.multipart import parse_form
from tandem.frontend.batch.store import BatchStore, FileRow
from tandem.frontend.http.message import HttpRequest, HttpResponse
from tandem.frontend.ownership import Ownership

PREFIX = "/v1/files"
PURPOSES = ("batch",)  # what a client may upload; batch_output is written by batches
_json = msgspec.json.Encoder()


def file_object(row: FileRow) -> dict[str, Any]:
    return {
        "id": row.id, "object": "file", "bytes": row.bytes, "created_at": row.created_at,
        "filename": row.filename, "purpose": row.purpose, "status": "processed",
        "expires_at": None, "status_details": None,
    }  # fmt: skip


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def not_found(kind: str, object_id: str, param: str) -> ServingError:
    err = InvalidRequest(f"No such {kind}: '{object_id[:80]}'", param=param)
    err.status_code = 404
    return err


def page(items: list[dict[str, Any]], query: str, *, max_limit: int) -> dict[str, Any]:
    """A cursor page of `items` (newest first) after the query's `after` id, `limit` long."""
    args = urllib.parse.parse_qs(query)
    after = args.get("after", [None])[0]
    try:
        limit = int(args.get("limit", ["20"])[0])
    except ValueError:
        limit = -1
    if not 1 <= limit <= max_limit:
        raise InvalidRequest(f"limit must be a whole number in [1, {max_limit}]", param="limit")
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    data = items[:limit]
    return {
        "object": "list", "data": data, "has_more": len(items) > limit,
        "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None,
    }  # fmt: skip


class FilesEndpoint:
    """The `/v1/files` routes; safe for concurrent requests (the store locks)."""

    def __init__(self, store: BatchStore, owners: Ownership, *, max_file_bytes: int) -> None:
        self.store, self.owners, self.max_file_bytes = store, owners, max_file_bytes

    async def upload(self, http: HttpRequest, response: HttpResponse) -> None:
        form = parse_form(http.headers.get("content-type", ""), http.body)
        purpose = form["purpose"].data.decode("utf-8", "replace") if "purpose" in form else None
        if purpose not in PURPOSES:
            raise InvalidRequest(
                f"purpose={purpose!r} is not supported; expected one of: {', '.join(PURPOSES)}",
                param="purpose",
            )
        upload = form.get("file")
        if upload is None or upload.filename is None:
            raise InvalidRequest("the form has no 'file' part with a filename", param="file")
        if len(upload.data) > self.max_file_bytes:
            err = InvalidRequest(
                f"file of {len(upload.data)} bytes exceeds the largest this frontend takes, "
                f"{self.max_file_bytes} bytes (--batch-max-file-mb); split it into several "
                "batches",
                param="file",
            )
            err.status_code = 413
            raise err
        row = FileRow(
            new_file_id(), self.owners.owner_of(http), purpose, upload.filename[:255],
            len(upload.data), int(time.time()),
        )  # fmt: skip
        await asyncio.to_thread(self.store.add_file, row, upload.data)
        await response.send(200, _json.encode(file_object(row)))

    async def index(self, http: HttpRequest, response: HttpResponse) -> None:
        purpose = urllib.parse.parse_qs(http.query).get("purpose", [None])[0]
        rows = await asyncio.to_thread(self.store.files, self.owners.owner_of(http), purpose)
        body = page([file_object(r) for r in rows], http.query, max_limit=10_000)
        await response.send(200, _json.encode(body))

    async def retrieve(self, http: HttpRequest, response: HttpResponse, file_id: str) -> None:
        row = await asyncio.to_thread(self.store.file, file_id, self.owners.owner_of(http))
        if row is None:
            raise not_found("file", file_id, "file_id")
        await response.send(200, _json.encode(file_object(row)))

    async def content(self, http: HttpRequest, response: HttpResponse, file_id: str) -> None:
        data = await asyncio.to_thread(self.store.file_content, file_id, self.owners.owner_of(http))
        if data is None:
            raise not_found("file", file_id, "file_id")
        await response.send(200, data, content_type=b"application/jsonl")

    async def delete(self, http: HttpRequest, response: HttpResponse, file_id: str) -> None:
        if not await asyncio.to_thread(self.store.delete_file, file_id, self.owners.owner_of(http)):
            raise not_found("file", file_id, "file_id")
        await response.send(200, _json.encode({"id": file_id, "object": "file", "deleted": True}))
