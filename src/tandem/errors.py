"""The one error tree of tandem.

The frontend maps these to HTTP status codes and OpenAI error bodies in one place
(`tandem.frontend.errors`). Messages give the value, what was expected and a hint.
"""

from __future__ import annotations


class StartupError(Exception):
    """A process cannot start (a port that cannot be bound, a missing model file, a worker that
    exited before it was ready). `tandem` prints the message as one line and exits 1."""


class ServingError(Exception):
    """Base of every error tandem raises on purpose."""

    status_code: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(ServingError):
    """The client sent something we cannot serve (HTTP 400)."""

    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """Prompt (+ max_tokens) does not fit the model's context (HTTP 400)."""


class Unauthorized(ServingError):
    """No API key, or one not accepted (HTTP 401, OpenAI code `invalid_api_key`)."""

    status_code = 401
    error_type = "invalid_request_error"


class Forbidden(ServingError):
    """The route exists but is off or not for this key (HTTP 403)."""

    status_code = 403
    error_type = "permission_error"


class ModelNotFound(ServingError):
    """The requested model is not served here (HTTP 404)."""

    status_code = 404
    error_type = "model_not_found"


class Overloaded(ServingError):
    """A bounded queue is full; the client should retry later (HTTP 503 + Retry-After)."""

    status_code = 503
    error_type = "overloaded"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, param: str | None = None):
        super().__init__(message, param=param)
        self.retry_after_s = retry_after_s


class RateLimited(Overloaded):
    """Per-client limit reached (HTTP 429 + Retry-After). `headers`: more response headers
    (a tenant limit's `x-ratelimit-*`)."""

    status_code = 429
    error_type = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, param: str | None = None):
        super().__init__(message, retry_after_s=retry_after_s, param=param)
        self.headers: list[tuple[str, str]] = []


class NoWorkersAvailable(Overloaded):
    """No instance serves the endpoint right now (HTTP 503)."""

    error_type = "service_unavailable"


class ModelUnavailable(ServingError):
    """The model is listed but could not be loaded here (its tokenizer file missing or corrupt):
    HTTP 503 naming the model and the file."""

    status_code = 503
    error_type = "service_unavailable"


class EngineError(ServingError):
    """The engine failed while serving a request."""

    error_type = "engine_error"


class TransferError(ServingError):
    """A KV transfer failed, timed out or was cancelled."""

    error_type = "transfer_error"


class PeerGone(ServingError):
    """The remote end of a request-plane stream disappeared (connection lost, process died)."""

    status_code = 503
    error_type = "peer_gone"


class DeadlineExceeded(ServingError):
    """A request's deadline passed before it finished."""

    status_code = 504
    error_type = "timeout"


class ConfigError(ValueError):
    """A configuration value that is not accepted: out of range (the message names field, value
    and allowed range), or a flag's value from the environment or a config file
    (`tandem.runtime.flag_parser`; the message names what was expected)."""
