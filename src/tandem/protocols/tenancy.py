"""Who is asking and how urgently (issue 33): a request's tenant, priority class, deadline and
session, as the frontend resolves them and the router's queue reads them.

Priority follows vLLM's `priority` request field: an int, lower = served earlier, default 0.
tandem serves four classes; each has a name (the `x-tandem-priority` header takes either):

    high = -1 · normal = 0 (the default) · low = 1 · batch = 2 (the batch lane, the lowest)

Any other value is an unknown class (400), never clamped."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.errors import InvalidRequest

PRIORITY_CLASSES: dict[str, int] = {"high": -1, "normal": 0, "low": 1, "batch": 2}
CLASS_NAMES: dict[int, str] = {v: k for k, v in PRIORITY_CLASSES.items()}
BATCH_PRIORITY = PRIORITY_CLASSES["batch"]
DEFAULT_PRIORITY = PRIORITY_CLASSES["normal"]
DEFAULT_TENANT = "default"
MAX_TENANT_CHARS = 64
MAX_SESSION_CHARS = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestIdentity:
    """One request's tenant, priority class (an int of `PRIORITY_CLASSES`), absolute deadline
    (`time.time()` seconds; None = only the frontend's request timeout) and session id (the
    router binds a session to a worker; None = no binding)."""

    tenant: str = DEFAULT_TENANT
    priority: int = DEFAULT_PRIORITY
    deadline_s: float | None = None
    session_id: str | None = None

    def __post_init__(self) -> None:
        if self.priority not in CLASS_NAMES:
            raise ValueError(f"priority={self.priority} is not a class; {classes_hint()}")


DEFAULT_IDENTITY = RequestIdentity()  # the default tenant at the default class, nothing else


def classes_hint() -> str:
    """The valid classes, as error messages list them."""
    shown = ", ".join(f"{v} ({k})" for k, v in PRIORITY_CLASSES.items())
    return f"expected one of: {shown}"


def parse_priority(value: object, *, param: str) -> int:
    """A client's priority (an int, or a class name from a header) as a class int; raises
    InvalidRequest naming `param` and the classes for anything else."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in PRIORITY_CLASSES:
            return PRIORITY_CLASSES[text]
        try:
            value = int(text)
        except ValueError:
            value = text
    if isinstance(value, int) and not isinstance(value, bool) and value in CLASS_NAMES:
        return value
    shown = repr(value)[:40]
    raise InvalidRequest(f"unknown priority class {shown}; {classes_hint()}", param=param)


def class_name(priority: int) -> str:
    """The name of class `priority` (metrics labels); an unknown int shows as itself."""
    return CLASS_NAMES.get(priority, str(priority))
