"""Request ids: the X-Request-ID header's validation and the ids of requests without one."""

from __future__ import annotations

import itertools
import os
import re

from tandem.errors import InvalidRequest
from tandem.protocols.openai import show_value

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces


class _IdSource:
    """32 hex digits: a random prefix per process (drawn again in a forked child) and a
    counter. uuid4 reads os.urandom per id, a syscall per request on the hot path."""

    def __init__(self) -> None:
        self.reset()
        os.register_at_fork(after_in_child=self.reset)

    def reset(self) -> None:
        self.prefix = os.urandom(8).hex()
        self.counter = itertools.count(1)

    def __call__(self) -> str:
        return f"{self.prefix}{next(self.counter):016x}"


new_request_id = _IdSource()


def client_request_id(headers: dict[str, str]) -> str | None:
    """The client's X-Request-ID, or None; raises InvalidRequest for one that is too long or
    not printable ASCII (it lands in logs, ids and a response header)."""
    value = headers.get(REQUEST_ID_HEADER)
    if value is None:
        return None
    if len(value) > MAX_REQUEST_ID_CHARS or not _REQUEST_ID.fullmatch(value):
        raise InvalidRequest(
            f"X-Request-ID={show_value(value)} is invalid; expected 1 to "
            f"{MAX_REQUEST_ID_CHARS} printable ASCII characters without spaces",
            param="X-Request-ID",
        )
    return value
