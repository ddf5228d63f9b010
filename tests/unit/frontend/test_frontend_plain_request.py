"""A plain request skips the stages it does not use (issue 29's walk), and skipping them
decides as running them would: the app calls `ApiKeys.check` only on `checked_paths`, and
without a tenants file resolves an identity only for a request that sends an identity header."""

from __future__ import annotations

import pytest

from tandem.errors import ServingError
from tandem.frontend.app import API_ENDPOINTS
from tandem.frontend.auth import ADMIN_PATHS, OPEN_PATHS, OPERATOR_PATHS, ApiKeys
from tandem.frontend.http.message import HttpRequest
from tandem.frontend.tenancy import IDENTITY_HEADERS, Tenancy
from tandem.protocols.tenancy import DEFAULT_IDENTITY

PATHS = sorted({*API_ENDPOINTS, *OPEN_PATHS, *OPERATOR_PATHS, *ADMIN_PATHS, "/metrics"})
HEADER_VALUES = {
    "x-tenant-id": "default",
    "x-tandem-priority": "low",
    "x-tandem-deadline-ms": "5000",
    "x-session-id": "s1",
}


def _refuses(keys: ApiKeys, path: str) -> bool:
    try:
        keys.check(HttpRequest("POST", path, "", {}))
    except ServingError:
        return True
    return False


@pytest.mark.parametrize("path", PATHS)
def test_without_keys_only_the_checked_paths_can_be_refused(path: str) -> None:
    keys = ApiKeys((), ())
    assert keys.checked_paths is not None
    assert _refuses(keys, path) == (path in keys.checked_paths)


def test_with_a_key_every_path_is_checked() -> None:
    user, admin = ApiKeys(("k1",), ()), ApiKeys((), ("admin",))
    assert user.checked_paths is None and admin.checked_paths is None
    assert _refuses(user, "/v1/chat/completions")
    assert _refuses(admin, "/dashboard/state")  # open while no key at all is configured


def test_without_a_tenants_file_a_request_without_identity_headers_is_the_default() -> None:
    tenancy = Tenancy()
    plain = HttpRequest("POST", "/v1/chat/completions", "", {"content-type": "application/json"})
    assert IDENTITY_HEADERS.isdisjoint(plain.headers)
    assert tenancy.resolve(plain) is DEFAULT_IDENTITY
    assert set(HEADER_VALUES) == IDENTITY_HEADERS
    for name, value in HEADER_VALUES.items():  # each header alone is read (the app resolves)
        request = HttpRequest("POST", "/v1/chat/completions", "", {name: value})
        assert not IDENTITY_HEADERS.isdisjoint(request.headers)
        if name != "x-tenant-id":  # naming the default tenant is the default identity
            assert tenancy.resolve(request) != DEFAULT_IDENTITY, name
