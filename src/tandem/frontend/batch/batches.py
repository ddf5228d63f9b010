"""`/v1/batches` (OpenAI's Batch API): create from an uploaded JSONL file, retrieve, list,
cancel. Creating checks the request and every line at once: a line that is not a request
this lane can run (bad JSON, another endpoint, no `custom_id`, a repeated one, `stream`, a
priority other than the batch class) is failed on the spot and reported in the batch's error
file; the rest run (`runner.py`). A batch naming a model that is not served is refused whole.
A batch belongs to its creator (`frontend/ownership.py`)."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable
from typing import Any

import msgspec

from tandem.errors import InvalidRequest, ServingError
from tandem.frontend.batch.files import not_found, page
from tandem.frontend.batch.store import BatchStore, NewLine
from tandem.frontend.http.message import HttpRequest, HttpResponse
from tandem.frontend.models import ModelRegistry
from tandem.frontend.ownership import Ownership
from tandem.protocols.tenancy import BATCH_PRIORITY, CLASS_NAMES

PREFIX = "/v1/batches"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
WINDOW_S = {"24h": 86_400}
_FIELDS = {"input_file_id", "endpoint", "completion_window", "metadata"}
_json = msgspec.json.Encoder()


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def error_line(custom_id: str, code: str, message: str) -> bytes:
    """An error-file line for a request that never ran (OpenAI's shape: no response)."""
    line = {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": custom_id,
            "response": None, "error": {"code": code, "message": message}}  # fmt: skip
    return json.dumps(line).encode()


class BatchesEndpoint:
    """The `/v1/batches` routes; `on_created` wakes the runner."""

    def __init__(
        self,
        store: BatchStore,
        owners: Ownership,
        registry: ModelRegistry,
        *,
        max_lines: int,
        on_created: Callable[[], None],
    ) -> None:
        self.store, self.owners, self.registry = store, owners, registry
        self.max_lines, self.on_created = max_lines, on_created

    async def create(self, http: HttpRequest, response: HttpResponse) -> None:
        req = _request(http.body)
        owner = self.owners.owner_of(http)
        row = await asyncio.to_thread(self.store.file, req["input_file_id"], owner)
        if row is None:
            raise not_found("file", req["input_file_id"], "input_file_id")
        if row.purpose != "batch":
            raise InvalidRequest(
                f"file {row.id} has purpose {row.purpose!r}; a batch reads a file uploaded "
                "with purpose 'batch'",
                param="input_file_id",
            )
        content = await asyncio.to_thread(self.store.file_content, row.id, owner)
        lines = self._lines(content or b"", req["endpoint"])
        now = int(time.time())
        body = {
            "id": new_batch_id(), "object": "batch", "endpoint": req["endpoint"],
            "errors": None, "input_file_id": row.id,
            "completion_window": req["completion_window"], "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": now,
            "in_progress_at": None, "expires_at": now + WINDOW_S[req["completion_window"]],
            "finalizing_at": None, "completed_at": None, "failed_at": None,
            "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "metadata": req.get("metadata"),
        }  # fmt: skip
        await asyncio.to_thread(self.store.add_batch, body, owner, lines)
        self.on_created()
        await self._send(response, body["id"], owner)

    async def retrieve(self, http: HttpRequest, response: HttpResponse, batch_id: str) -> None:
        await self._send(response, batch_id, self.owners.owner_of(http))

    async def index(self, http: HttpRequest, response: HttpResponse) -> None:
        items = await asyncio.to_thread(self.store.batches, self.owners.owner_of(http))
        await response.send(200, _json.encode(page(items, http.query, max_limit=100)))

    async def cancel(self, http: HttpRequest, response: HttpResponse, batch_id: str) -> None:
        """validating or in_progress → cancelling (the runner stops its lines, then cancelled,
        with the results so far in its files); a batch already ended is answered as it is."""
        owner = self.owners.owner_of(http)
        batch = await asyncio.to_thread(self.store.batch, batch_id, owner)
        if batch is None:
            raise not_found("batch", batch_id, "batch_id")
        if batch["status"] in ("validating", "in_progress"):
            await asyncio.to_thread(
                self.store.update, batch_id, "cancelling", cancelling_at=int(time.time())
            )
            self.on_created()
        await self._send(response, batch_id, owner)

    async def _send(self, response: HttpResponse, batch_id: str, owner: str) -> None:
        batch = await asyncio.to_thread(self.store.batch, batch_id, owner)
        if batch is None:
            raise not_found("batch", batch_id, "batch_id")
        await response.send(200, _json.encode(batch))

    def _lines(self, content: bytes, endpoint: str) -> list[NewLine]:
        """Every non-blank line of the input as a runnable or failed line; InvalidRequest
        for a file with no line, too many, or a model that is not served."""
        raw = [ln for ln in content.splitlines() if ln.strip()]
        if not raw:
            raise InvalidRequest("the input file has no request lines", param="input_file_id")
        if len(raw) > self.max_lines:
            raise InvalidRequest(
                f"the input file has {len(raw)} lines; at most {self.max_lines} per batch",
                param="input_file_id",
            )
        seen: set[str] = set()
        out: list[NewLine] = []
        for number, text in enumerate(raw, 1):
            try:
                custom_id, body = _line(text, endpoint, number, seen)
                self._check_model(body, number)
            except _BadLine as exc:
                out.append(NewLine(exc.custom_id, None, error_line(exc.custom_id, exc.code,
                                                                   exc.message)))  # fmt: skip
                continue
            seen.add(custom_id)
            out.append(NewLine(custom_id, json.dumps(body).encode(), None))
        return out

    def _check_model(self, body: dict[str, Any], number: int) -> None:
        try:
            self.registry.get(body["model"])
        except ServingError as exc:
            raise InvalidRequest(f"line {number}: {exc.message}", param="input_file_id") from exc


class _BadLine(Exception):
    def __init__(self, custom_id: str, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.custom_id, self.message, self.code = custom_id, message, code


def _line(text: bytes, endpoint: str, number: int, seen: set[str]) -> tuple[str, dict[str, Any]]:
    fallback = f"line-{number}"
    try:
        item = json.loads(text)
    except ValueError as exc:
        raise _BadLine(fallback, f"line {number} is not valid JSON: {exc}") from exc
    if not isinstance(item, dict):
        raise _BadLine(fallback, f"line {number} is not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= 512:
        raise _BadLine(fallback, f"line {number}: custom_id must be a string of 1 to 512 chars")
    if custom_id in seen:
        raise _BadLine(custom_id, f"line {number}: custom_id {custom_id!r} is repeated; each "
                       "line needs its own")  # fmt: skip
    if item.get("method") != "POST":
        raise _BadLine(custom_id, f"line {number}: method must be 'POST'")
    if item.get("url") != endpoint:
        raise _BadLine(custom_id, f"line {number}: url {str(item.get('url'))[:80]!r} is not "
                       f"the batch's endpoint {endpoint!r}")  # fmt: skip
    body = item.get("body")
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        raise _BadLine(custom_id, f"line {number}: body must be an object naming a model")
    if body.get("stream"):
        raise _BadLine(custom_id, f"line {number}: stream is not supported in a batch")
    if body.get("priority", BATCH_PRIORITY) != BATCH_PRIORITY:
        raise _BadLine(custom_id, f"line {number}: a batch runs at priority {BATCH_PRIORITY} "
                       f"({CLASS_NAMES[BATCH_PRIORITY]}); leave priority out")  # fmt: skip
    return custom_id, body


def _request(raw: bytes) -> dict[str, Any]:
    try:
        req = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest(f"body is not valid JSON: {exc}") from exc
    if not isinstance(req, dict):
        raise InvalidRequest("body must be a JSON object")
    if unknown := sorted(set(req) - _FIELDS):
        raise InvalidRequest(f"unsupported field(s) {unknown}; expected {sorted(_FIELDS)}",
                             param=unknown[0])  # fmt: skip
    if not isinstance(req.get("input_file_id"), str):
        raise InvalidRequest("input_file_id is required", param="input_file_id")
    if req.get("endpoint") not in ENDPOINTS:
        raise InvalidRequest(
            f"endpoint {str(req.get('endpoint'))[:80]!r} is not supported; expected one of: "
            f"{', '.join(ENDPOINTS)}",
            param="endpoint",
        )
    if req.get("completion_window") not in WINDOW_S:
        raise InvalidRequest(
            f"completion_window {str(req.get('completion_window'))[:20]!r}; expected '24h'",
            param="completion_window",
        )
    meta = req.get("metadata")
    if meta is not None and not (
        isinstance(meta, dict) and len(meta) <= 16
        and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    ):  # fmt: skip
        raise InvalidRequest("metadata: at most 16 string keys and values", param="metadata")
    return req
