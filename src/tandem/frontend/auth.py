"""API keys at the HTTP edge.

With API keys configured, the API routes and /metrics need a key, sent as
`Authorization: Bearer <key>` (OpenAI's way) or `x-api-key: <key>` (Anthropic's), on every
route; 401 otherwise (in the route's API's error shape). When both headers are sent the
Bearer key is the one checked. `/health` and `/live` are always open (probes).
Admin routes — `POST /v1/route/explain`, an oracle for which prefixes other clients sent —
need an admin key, and are off (403) when no admin key is configured. An admin key is
accepted on every route. `/dashboard` (a static page) is open; the data it polls,
`/dashboard/state` (workers, queues, recent routing decisions of every client), is open
while no key at all is configured and otherwise needs an admin key (403 with API keys but
no admin key); so do `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from tandem.errors import Forbidden, Unauthorized
from tandem.frontend.http.server import HttpRequest

OPEN_PATHS = frozenset({"/health", "/live", "/dashboard"})  # /dashboard: the page, no data
ADMIN_PATHS = frozenset({"/v1/route/explain"})
# operator views and actions: open while no key is configured at all, else an admin key
# (loading a LoRA adapter reads a directory on the workers' hosts)
OPERATOR_PATHS = frozenset({"/dashboard/state", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


class ApiKeys:
    """Checks one request's credentials; immutable, safe to share."""

    def __init__(
        self,
        api_keys: tuple[str, ...],
        admin_api_keys: tuple[str, ...],
        *,
        is_tenant_key: Callable[[str], bool] | None = None,
    ) -> None:
        self._admin = [k.encode() for k in admin_api_keys]
        self._user = [k.encode() for k in api_keys]
        # the keys a tenants file lists are user keys too (issue 33; reloaded with the file)
        self._is_tenant_key = is_tenant_key
        # the paths `check` may refuse (None: every path but the open ones); with no key
        # configured only the admin routes, which are off, so the app asks for no others
        self.checked_paths: frozenset[str] | None = (
            None if self._admin or self._user else ADMIN_PATHS
        )

    def check(self, request: HttpRequest) -> None:
        """Raise Unauthorized (401) or Forbidden (403) unless `request` may use its route."""
        path = request.path
        if path in OPEN_PATHS:
            return
        if path in OPERATOR_PATHS and (self._admin or self._user):
            if not self._admin:
                raise Forbidden(
                    f"{request.method} {path} is an operator route and needs an admin "
                    "API key; start the frontend with --admin-api-key (or "
                    "TANDEM_ADMIN_API_KEY) to enable it"
                )
            self._require(request, self._admin, "an admin API key")
        elif path in ADMIN_PATHS:
            if not self._admin:
                raise Forbidden(
                    f"{request.method} {path} is an admin route and is off; start the frontend "
                    "with --admin-api-key (or TANDEM_ADMIN_API_KEY) to enable it"
                )
            self._require(request, self._admin, "an admin API key")
        elif self._user:
            self._require(request, self._user + self._admin, "an API key", self._is_tenant_key)

    @staticmethod
    def _require(
        request: HttpRequest,
        keys: list[bytes],
        what: str,
        is_tenant_key: Callable[[str], bool] | None = None,
    ) -> None:
        header = request.headers.get("authorization")
        if header is None:  # Anthropic's clients send the key as x-api-key
            scheme, token = "bearer", request.headers.get("x-api-key", "")
        else:
            scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized(
                f"{request.method} {request.path} needs {what}: send it as "
                "'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            )
        presented = token.strip().encode("latin-1")
        # compare with every key, no early exit: the time taken does not tell which matched
        matched = False
        for key in keys:
            matched |= hmac.compare_digest(presented, key)
        if not matched and is_tenant_key is not None:
            matched = is_tenant_key(token.strip())  # a dict lookup: keyed by the whole key
        if not matched:
            raise Unauthorized(f"incorrect API key provided: {_mask(token.strip())}")


def _mask(key: str) -> str:
    return f"{key[:3]}***{key[-2:]}" if len(key) > 8 else "***"
