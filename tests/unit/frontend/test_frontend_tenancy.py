"""The tenants file (issue 33): a bad file is a clear error at start and keeps the old tables
at reload; limit buckets in one SQLite file are shared by every limiter (process) that opens it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem.errors import ConfigError, RateLimited
from tandem.frontend.http.message import HttpRequest
from tandem.frontend.rate_limit import RateLimiter
from tandem.frontend.tenancy import Tenancy, load_tenants, parse_tenants

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([1, 2], "expected a mapping with a 'tenants' key"),
        ({"tenant": {}}, r"unknown key\(s\) \['tenant'\]"),
        ({"tenants": {"a": {"weight": 0}}}, "tenants.a.weight=0"),
        ({"tenants": {"a": {"weight": "heavy"}}}, "expected a number"),
        ({"tenants": {"a": {"max_priority": "urgent"}}}, "unknown priority class 'urgent'"),
        ({"tenants": {"a": {"max_priority": "low", "default_priority": "normal"}}}, "above"),
        ({"tenants": {"a": {"requests_per_minute": 1.5}}}, "expected a whole number"),
        ({"tenants": {"a": {"isolated": "yes"}}}, "expected true or false"),
        ({"tenants": {"a b": {}}}, "tenant name 'a b' invalid"),
        ({"tenants": {"a": {"api_keys": ["k"]}, "b": {"api_keys": ["k"]}}}, "listed under a"),
        ({"tenants": {"a": {}}, "default_tenant": "b"}, "default_tenant 'b' is not one"),
        ({"tenants": {"a": {"colour": 1}}}, r"tenants.a: unknown key\(s\) \['colour'\]"),
    ],
)
def test_bad_tenants_files_name_the_problem(raw: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_tenants(raw, where="t.yaml")


def test_reload_keeps_the_old_tables_when_the_new_file_is_bad(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("tenants: {a: {weight: 3, api_keys: [sk-a]}}")
    now = [0.0]
    tenancy = Tenancy(path, clock=lambda: now[0])
    seen = []
    tenancy.on_change(lambda table: seen.append(sorted(table.tenants)))
    path.write_text("tenants: {a: {weight: -1}}")
    os.utime(path, ns=(1, 10**18))
    now[0] = 5.0
    tenancy.maybe_reload()
    assert tenancy.table.get("a").weight == 3 and tenancy.num_reload_failures == 1
    path.write_text("tenants: {a: {weight: 1}, b: {}}")
    os.utime(path, ns=(1, 2 * 10**18))
    now[0] = 10.0
    tenancy.maybe_reload()
    assert seen == [["a"], ["a", "b"]]
    request = HttpRequest("POST", "/v1/completions", "", {"authorization": "Bearer sk-a"})
    assert tenancy.resolve(request).tenant == "default"  # sk-a is no longer listed
    with pytest.raises(ConfigError, match="cannot read tenants file"):
        load_tenants(tmp_path / "missing.yaml")


def test_limit_buckets_are_shared_through_the_file(tmp_path: Path) -> None:
    now = [1000.0]
    one = RateLimiter(tmp_path / "l.sqlite", clock=lambda: now[0])
    two = RateLimiter(tmp_path / "l.sqlite", clock=lambda: now[0])  # another frontend process
    one.take("a", {"requests": (3, 1.0)})
    two.take("a", {"requests": (3, 1.0)})
    state = one.take("a", {"requests": (3, 1.0)})["requests"]
    assert state.remaining == 0 and state.reset_s == pytest.approx(60.0)
    with pytest.raises(RateLimited) as exc:
        two.take("a", {"requests": (3, 1.0)})
    assert exc.value.retry_after_s == pytest.approx(20.0)
    assert ("x-ratelimit-remaining-requests", "0") in exc.value.headers
    two.take("b", {"requests": (3, 1.0)})  # another tenant's bucket
    now[0] += 20.0  # refills at 3/min
    one.take("a", {"requests": (3, 1.0)})
    # generated tokens are charged after the fact and may leave a debt
    state = one.take("a", {"tokens": (100, 250.0)}, allow_debt=True)["tokens"]
    assert state.remaining == -150
    with pytest.raises(RateLimited, match="retry after 91 s"):
        two.take("a", {"tokens": (100, 1.0)})
    one.close()
    two.close()
