"""Log lines as text or as JSON, and the request id every request-scoped line carries.

`current_request_id` is a context variable: the frontend sets it when a generate request
starts (its `chatcmpl-…`/`cmpl-…` id), the worker when the request plane hands it a request
(the same id, with a `-<i>` suffix per choice of a fanned-out request and `-m<k>` per
migration). Each request runs in its own task, so a value set there is seen by every line
that task logs and by the tasks it creates, and by nothing else. Only JSON lines print it, so
both set it only once a JsonFormatter exists (`request_ids_logged`).

`--log-format json` (`tandem.runtime.process_setup.configure_logging`) writes one JSON object per
line: `ts` (UTC, ISO 8601, milliseconds), `level`, `logger`, `message`, `request_id` when
the line is request-scoped, `exc_info` with the traceback when there is one.
"""

from __future__ import annotations

import json
import logging
from contextvars import ContextVar, Token
from datetime import UTC, datetime

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

current_request_id: ContextVar[str | None] = ContextVar("tandem_request_id", default=None)
# whether any line carries `request_id`: a JsonFormatter was made (the text format prints
# none); request code enters `request_scope` only then (`request_ids_logged` is read per request)
request_ids_logged = False


class request_scope:
    """Lines logged inside the block (by this task and tasks it starts) carry `request_id`.
    Enter and leave in the same task and without a `yield` of an async generator between.
    A plain class, not `contextlib.contextmanager`: it runs on every request (~0.3 µs)."""

    __slots__ = ("_request_id", "_token")

    def __init__(self, request_id: str) -> None:
        self._request_id = request_id
        self._token: Token[str | None] | None = None

    def __enter__(self) -> None:
        self._token = current_request_id.set(self._request_id)

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            current_request_id.reset(self._token)
            self._token = None


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in messages are escaped)."""

    def __init__(self) -> None:
        super().__init__()
        global request_ids_logged
        request_ids_logged = True  # from now on requests set `current_request_id`

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = current_request_id.get()
        if request_id is not None:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc_info"] = record.exc_text
        if record.stack_info:
            entry["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def make_formatter(log_format: str) -> logging.Formatter:
    """The formatter `--log-format` names; ValueError naming the choices otherwise."""
    if log_format == "json":
        return JsonFormatter()
    if log_format == "text":
        return logging.Formatter(TEXT_FORMAT)
    raise ValueError(
        f"unknown log format '{log_format}'; expected one of: {', '.join(LOG_FORMATS)}"
    )
