"""What `tandem_frontend_requests_total` learns of the running request while it runs.

The app opens a tally per request (`open_tally`); the handlers label it (`count_as`) once
the model is known to be served, so there is no label per mistyped name."""

from __future__ import annotations

from contextvars import ContextVar, Token
from dataclasses import dataclass


@dataclass(slots=True)
class RequestTally:
    """One request's labels and outcome."""

    model: str = ""
    request_type: str = "unary"
    status: str = "success"
    status_code: int = 200


_tally: ContextVar[RequestTally] = ContextVar("tandem_frontend_tally")


def open_tally() -> tuple[RequestTally, Token[RequestTally]]:
    """A new tally for the running request; `close_tally(token)` when it ends."""
    tally = RequestTally()
    return tally, _tally.set(tally)


def close_tally(token: Token[RequestTally]) -> None:
    _tally.reset(token)


def count_as(model: str, *, stream: bool, failed: bool = False) -> None:
    """Label the running request's sample; `failed` for an error already written into a
    started stream. Nothing when no tally is open (a handler called on its own)."""
    tally = _tally.get(None)
    if tally is not None:
        tally.model, tally.request_type = model, "stream" if stream else "unary"
        if failed:
            tally.status = "error"
