"""Who owns what a client stores (issue 33): stored `/v1/responses`, `/v1/files` and
`/v1/batches` belong to the tenant or API key that made them, and every other caller is told
they do not exist (404, as OpenAI answers for ids a key cannot see).

An owner is a string:
- `tenant:<name>` when the request's API key is listed under a tenant of the tenants file
  (every key of one tenant sees the tenant's objects);
- `key:<sha256 of the key, 16 hex>` for any other API key (the key itself is never stored);
- `tenant:<name>` of the request's resolved tenant (the `x-tenant-id` header, else the default
  tenant) on a frontend without API keys: with no authentication, what a client presents as a
  key proves nothing, and objects are kept apart by tenant name only.
"""

from __future__ import annotations

import hashlib

from tandem.frontend.http.message import HttpRequest
from tandem.frontend.tenancy import Tenancy, current_identity, presented_key
from tandem.protocols.tenancy import DEFAULT_TENANT


class Ownership:
    """Owners of requests on one frontend; immutable, safe to share. `has_api_keys`: the
    frontend checks API keys (`--api-key` / `--admin-api-key`)."""

    def __init__(self, *, has_api_keys: bool = False, tenancy: Tenancy | None = None) -> None:
        self.has_api_keys, self.tenancy = has_api_keys, tenancy

    def owner_of(self, http: HttpRequest) -> str:
        """The owner of what `http` stores, and the only one that may read or delete it."""
        key = presented_key(http)
        tenancy = self.tenancy
        if key is not None:
            if tenancy is not None and (tenant := tenancy.table.by_key.get(key)) is not None:
                return f"tenant:{tenant}"
            if self.has_api_keys:  # checked by the app before any handler runs
                return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
        identity = current_identity.get(None)
        return f"tenant:{identity.tenant if identity is not None else DEFAULT_TENANT}"


def tenant_of(owner: str) -> str | None:
    """The tenant an owner names (None for a key owner: its requests run as the key's
    tenant, the default one)."""
    return owner.removeprefix("tenant:") if owner.startswith("tenant:") else None
