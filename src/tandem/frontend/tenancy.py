"""Tenants (issue 33): the `--tenants-file` YAML, its reload, and who is asking.

A request's tenant is its API key's tenant (keys are listed under their tenant in the file),
else the `x-tenant-id` header (it must name a configured tenant), else the default tenant.
Its priority class is the body's `priority` (vLLM's field), else the `x-tandem-priority` header
(a class name or int), else its tenant's `default_priority`; a class above the tenant's
`max_priority` is a 400 (never silently lowered). `x-tandem-deadline-ms` (a budget in ms from
arrival) sets its deadline. The file is read again when its mtime changes (checked at most
every `RELOAD_CHECK_S`); a file that fails to load keeps the tables in force (logged).

    default_tenant: default          # optional; must be one of `tenants` when given
    limits_db: /dev/shm/limits.db    # optional; frontends of one host that share it share limits
    session_from_user: false         # the body's `user` is the session id when no x-session-id
    tenants:
      acme:
        weight: 2                    # fair share within a class (> 0, default 1)
        max_priority: high           # highest class it may ask for (default high)
        default_priority: normal     # its class when a request names none (default normal)
        requests_per_minute: 600     # optional limits (429 + Retry-After + x-ratelimit-*)
        tokens_per_minute: 200000    # prompt tokens at admission + generated at the end
        isolated: false              # its KV never shared with other tenants (batch33)
        api_keys: [sk-acme-1]        # keys whose requests are acme's (valid API keys too)
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric

from tandem.config_check import check_range
from tandem.errors import ConfigError, InvalidRequest
from tandem.frontend.http.message import HttpRequest
from tandem.protocols.tenancy import (
    DEFAULT_IDENTITY,
    DEFAULT_PRIORITY,
    DEFAULT_TENANT,
    MAX_SESSION_CHARS,
    MAX_TENANT_CHARS,
    PRIORITY_CLASSES,
    RequestIdentity,
    class_name,
    classes_hint,
    parse_priority,
)

logger = logging.getLogger(__name__)

TENANT_HEADER = "x-tenant-id"
PRIORITY_HEADER = "x-tandem-priority"
DEADLINE_HEADER = "x-tandem-deadline-ms"
SESSION_HEADER = "x-session-id"
RELOAD_CHECK_S = 1.0
_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_TENANT_CHARS - 1}}}")
_TENANT_KEYS = frozenset(
    {"weight", "max_priority", "default_priority", "requests_per_minute",
     "tokens_per_minute", "isolated", "api_keys"}
)  # fmt: skip
# the headers that say who is asking; a frontend without a tenants file resolves an identity
# only for a request that sends one of them (the others are the default tenant's, FIFO)
IDENTITY_HEADERS = frozenset({TENANT_HEADER, PRIORITY_HEADER, DEADLINE_HEADER, SESSION_HEADER})
# the running request's identity, set by the app once its API key is checked (and by the
# batch lane for its lines); unset for a request with no identity to resolve and for code
# outside a request (which passes one explicitly)
current_identity: contextvars.ContextVar[RequestIdentity] = contextvars.ContextVar(
    "tandem_identity"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantConfig:
    """One tenant of the file; validated in __post_init__ (ValueError naming the field)."""

    name: str
    weight: float = 1.0
    max_priority: int = PRIORITY_CLASSES["high"]
    default_priority: int = DEFAULT_PRIORITY
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    isolated: bool = False
    api_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(
                f"tenant name {self.name!r} invalid; expected 1-{MAX_TENANT_CHARS} of "
                "[A-Za-z0-9._-], starting with a letter or digit"
            )
        check_range(f"tenants.{self.name}.weight", self.weight, low=0.001, high=1e6)
        if self.default_priority < self.max_priority:
            raise ValueError(
                f"tenants.{self.name}.default_priority={class_name(self.default_priority)} is "
                f"above its max_priority={class_name(self.max_priority)}"
            )
        for what in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, what)
            if value is not None:
                check_range(f"tenants.{self.name}.{what}", value, low=1)
        if any(not k or k != k.strip() for k in self.api_keys):
            raise ValueError(f"tenants.{self.name}.api_keys holds an empty key or one with spaces")


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantTable:
    """Every configured tenant; immutable (a reload builds a new one)."""

    tenants: Mapping[str, TenantConfig] = field(default_factory=dict)
    default_tenant: str = DEFAULT_TENANT
    limits_db: Path | None = None
    by_key: Mapping[str, str] = field(default_factory=dict)  # API key -> tenant name
    session_from_user: bool = False  # the body's `user` is the session id when no header

    def get(self, name: str) -> TenantConfig:
        """The named tenant; the default tenant (weight 1, no limits) when unconfigured."""
        return self.tenants.get(name) or _unconfigured(name)

    def weights(self) -> dict[str, float]:
        return {name: t.weight for name, t in self.tenants.items()}


_DEFAULT_FIELDS = (DEFAULT_TENANT, DEFAULT_PRIORITY, None, None)


@functools.lru_cache(maxsize=64)
def _unconfigured(name: str) -> TenantConfig:
    """A tenant the file does not name (the default one): weight 1, no limits; built once."""
    return TenantConfig(name=name)


def parse_tenants(raw: Any, *, where: str) -> TenantTable:
    """The YAML mapping of a tenants file as a TenantTable; ConfigError naming `where`."""
    try:
        return _parse(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"tenants file {where}: {exc}") from exc


def _parse(raw: Any) -> TenantTable:
    if not isinstance(raw, dict):
        raise ValueError("expected a mapping with a 'tenants' key")
    unknown = set(raw) - {"tenants", "default_tenant", "limits_db", "session_from_user"}
    if unknown:
        raise ValueError(
            f"unknown key(s) {sorted(unknown)}; expected tenants, default_tenant, limits_db, "
            "session_from_user"
        )
    if not isinstance(raw.get("session_from_user", False), bool):
        raise ValueError("session_from_user: expected true or false")
    entries = raw.get("tenants") or {}
    if not isinstance(entries, dict):
        raise ValueError("'tenants' must map tenant names to their settings")
    tenants: dict[str, TenantConfig] = {}
    by_key: dict[str, str] = {}
    for name, spec in entries.items():
        tenant = _tenant(str(name), spec or {})
        for key in tenant.api_keys:
            if key in by_key:
                raise ValueError(f"API key {key[:3]}*** is listed under {by_key[key]} and {name}")
            by_key[key] = tenant.name
        tenants[tenant.name] = tenant
    default = str(raw.get("default_tenant", DEFAULT_TENANT))
    if "default_tenant" in raw and default not in tenants:
        raise ValueError(f"default_tenant {default!r} is not one of the tenants {sorted(tenants)}")
    db = raw.get("limits_db")
    return TenantTable(
        tenants=tenants,
        default_tenant=default,
        limits_db=Path(db) if db else None,
        by_key=by_key,
        session_from_user=bool(raw.get("session_from_user", False)),
    )


def _tenant(name: str, spec: Any) -> TenantConfig:
    if not isinstance(spec, dict):
        raise ValueError(f"tenants.{name}: expected a mapping of settings")
    unknown = set(spec) - _TENANT_KEYS
    if unknown:
        raise ValueError(
            f"tenants.{name}: unknown key(s) {sorted(unknown)}; expected {sorted(_TENANT_KEYS)}"
        )
    kwargs: dict[str, Any] = {"name": name}
    for key in ("weight",):
        if key in spec:
            kwargs[key] = _number(spec[key], f"tenants.{name}.{key}")
    for key in ("requests_per_minute", "tokens_per_minute"):
        if spec.get(key) is not None:
            value = spec[key]
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"tenants.{name}.{key}={value!r}; expected a whole number")
            kwargs[key] = value
    for key in ("max_priority", "default_priority"):
        if key in spec:
            try:
                kwargs[key] = parse_priority(spec[key], param=key)
            except InvalidRequest as exc:
                raise ValueError(f"tenants.{name}.{key}: {exc.message}") from exc
    if "isolated" in spec:
        if not isinstance(spec["isolated"], bool):
            raise ValueError(
                f"tenants.{name}.isolated={spec['isolated']!r}; expected true or false"
            )
        kwargs["isolated"] = spec["isolated"]
    keys = spec.get("api_keys") or []
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ValueError(f"tenants.{name}.api_keys: expected a list of strings")
    kwargs["api_keys"] = tuple(keys)
    return TenantConfig(**kwargs)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what}={value!r}; expected a number")
    return float(value)


def load_tenants(path: Path) -> TenantTable:
    """Read and validate a tenants file; ConfigError with the reason."""
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read tenants file {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"tenants file {path} is not valid YAML: {exc}") from exc
    return parse_tenants(raw, where=str(path))


class TenantStats:
    """Per-tenant counters of one frontend: tokens served (prompt, output) and limit hits
    (requests, tokens); `collect` makes them Prometheus families. One event loop."""

    def __init__(self) -> None:
        self.tokens: Counter[tuple[str, str]] = Counter()  # (tenant, prompt|output)
        self.limited: Counter[tuple[str, str]] = Counter()  # (tenant, requests|tokens)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        p = "tandem_frontend_tenant"
        tokens = CounterMetricFamily(
            f"{p}_tokens", "tokens served per tenant (prompt, output)", labels=("tenant", "kind")
        )
        limited = CounterMetricFamily(
            f"{p}_rate_limited",
            "requests answered 429 by a tenant's requests/min or tokens/min limit",
            labels=("tenant", "limit"),
        )
        for (tenant, kind), n in sorted(self.tokens.items()):
            tokens.add_metric((tenant, kind), n)
        for (tenant, kind), n in sorted(self.limited.items()):
            limited.add_metric((tenant, kind), n)
        yield tokens
        yield limited


class Tenancy:
    """The tenant table in force and request identity. One event loop; `on_change` (the
    router queues' weights, the limiter) is called with each table loaded."""

    def __init__(
        self,
        path: Path | None = None,
        *,
        table: TenantTable | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self._clock = clock
        self._listeners: list[Callable[[TenantTable], None]] = []
        self._mtime_ns = -1
        self._checked = clock()
        self.num_reload_failures = 0
        self.stats = TenantStats()
        if path is not None:
            self._mtime_ns = _mtime_ns(path)
            self.table = load_tenants(path)  # at start a bad file is fatal
        else:
            self.table = table or TenantTable()

    @property
    def is_configured(self) -> bool:
        return bool(self.table.tenants)

    def on_change(self, listener: Callable[[TenantTable], None]) -> None:
        self._listeners.append(listener)
        listener(self.table)

    def maybe_reload(self) -> None:
        """Read the file again if its mtime changed (at most every RELOAD_CHECK_S)."""
        now = self._clock()
        if self.path is None or now - self._checked < RELOAD_CHECK_S:
            return
        self._checked = now
        mtime = _mtime_ns(self.path)
        if mtime == self._mtime_ns:
            return
        self._mtime_ns = mtime
        try:
            table = load_tenants(self.path)
        except ConfigError as exc:
            self.num_reload_failures += 1
            logger.error("tenants file not reloaded, the previous one stays in force: %s", exc)
            return
        self.table = table
        logger.info("tenants file %s reloaded: %d tenants", self.path, len(table.tenants))
        for listener in self._listeners:
            listener(table)

    def has_key(self, key: str) -> bool:
        return key in self.table.by_key

    def resolve(self, http: HttpRequest, *, now_s: float | None = None) -> RequestIdentity:
        """The identity of `http` from its key and headers (InvalidRequest on a bad header)."""
        self.maybe_reload()
        table = self.table
        tenant = table.by_key.get(presented_key(http) or "")
        if tenant is None:
            tenant = table.default_tenant
            named = http.headers.get(TENANT_HEADER)
            if named is not None and named.strip() != tenant:
                named = named.strip()
                if named not in table.tenants:
                    configured = "the configured tenants" if table.tenants else (
                        "none: no tenants are configured (--tenants-file)"
                    )  # fmt: skip
                    raise InvalidRequest(
                        f"unknown tenant {named[:MAX_TENANT_CHARS]!r} in {TENANT_HEADER}; "
                        f"expected one of {configured}",
                        param=TENANT_HEADER,
                    )
                tenant = named
        config = table.get(tenant)
        priority = config.default_priority
        if (header := http.headers.get(PRIORITY_HEADER)) is not None:
            priority = self.check_ceiling(tenant, parse_priority(header, param=PRIORITY_HEADER),
                                          param=PRIORITY_HEADER)  # fmt: skip
        deadline_s = _deadline(http.headers.get(DEADLINE_HEADER), now_s)
        session_id = session_of(http.headers)
        if (tenant, priority, deadline_s, session_id) == _DEFAULT_FIELDS:
            return DEFAULT_IDENTITY  # most requests: built once, not per request
        return RequestIdentity(
            tenant=tenant, priority=priority, deadline_s=deadline_s, session_id=session_id
        )

    def check_ceiling(self, tenant: str, priority: int, *, param: str) -> int:
        """`priority`, or InvalidRequest when it is above `tenant`'s max_priority."""
        ceiling = self.table.get(tenant).max_priority
        if priority < ceiling:
            raise InvalidRequest(
                f"priority {priority} ({class_name(priority)}) is above tenant {tenant!r}'s "
                f"ceiling {ceiling} ({class_name(ceiling)}); ask for {ceiling} or a lower class "
                f"(higher number); {classes_hint()}",
                param=param,
            )
        return priority


def _deadline(value: str | None, now_s: float | None) -> float | None:
    if value is None:
        return None
    try:
        budget_ms = int(value.strip())
    except ValueError:
        budget_ms = -1
    if not 1 <= budget_ms <= 86_400_000:
        raise InvalidRequest(
            f"{DEADLINE_HEADER}={value[:40]!r} malformed; expected a whole number of "
            "milliseconds from arrival in [1, 86400000]",
            param=DEADLINE_HEADER,
        )
    return (time.time() if now_s is None else now_s) + budget_ms / 1000


def session_of(headers: Mapping[str, str]) -> str | None:
    """The request's `x-session-id` (None when absent or blank; 400 when too long)."""
    value = headers.get(SESSION_HEADER)
    if value is None or not value.strip():
        return None
    if len(value) > MAX_SESSION_CHARS:
        raise InvalidRequest(
            f"{SESSION_HEADER} has {len(value)} characters; at most {MAX_SESSION_CHARS}",
            param=SESSION_HEADER,
        )
    return value.strip()


def presented_key(http: HttpRequest) -> str | None:
    """The API key the request presents (Bearer, else x-api-key), or None."""
    header = http.headers.get("authorization")
    if header is not None:
        scheme, _, token = header.partition(" ")
        return token.strip() or None if scheme.lower() == "bearer" else None
    return http.headers.get("x-api-key", "").strip() or None


def _mtime_ns(path: Path) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1
