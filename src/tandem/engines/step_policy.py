"""Who gets an engine's seats and a step's tokens first when classes and tenants share it
(issue 33); the mocker's and the native engine's schedulers both follow it.

Seats: within a priority class, a tenant's share of the engine's `max_num_seqs` (less the
seats more urgent classes hold) is its weight over the weights of the tenants with work
(running or waiting) in that class on this engine. A tenant is *over* its share when it holds
a whole seat more than it, and has *room* when one more seat keeps it within it (seats are
whole: one seat of rounding either way is never acted on).

A sequence *outranks* another when it is of a more urgent class (lower priority), or of the
same class while its tenant has room and the other's tenant is over. Outranked sequences
are the step's *background*:

- seats: when every seat is taken, a waiting sequence that outranks a running one has it
  preempted (recompute): the least urgent class first, the tenant furthest over its share,
  its youngest sequence (`victim`);
- tokens: background sequences get the decodes, then the prefill tokens, that keep the step
  within (1 + slack) x the cost of the foreground's own step (slack: the engines'
  `--background-step-slack`, default `BACKGROUND_STEP_SLACK`)
  (`background_allowance`): stall-free batching with a bounded step rather than a fixed
  chunk. The cost is the engine's (the mocker's perf model, where a decode pass costs the
  same for one sequence or many; the native engine counts tokens).

Work-conserving: a class or a tenant alone on the engine is outranked by nobody, so it gets
every seat and the whole token budget.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, TypeVar

from tandem.protocols.tenancy import DEFAULT_TENANT

# The default of how much longer a step may get for the background work it carries, as a
# fraction of the step without it: the interference an interactive request accepts from the
# lower classes and the over-share tenants beside it. A product choice, not a measurement:
# issue 33's batch-lane target (interactive TTFT within +10 % of a run without the batch).
# Engines take it as --background-step-slack (more: background throughput; less: latency).
BACKGROUND_STEP_SLACK = 0.1
MAX_BACKGROUND_STEP_SLACK = 100.0
BACKGROUND_STEP_SLACK_HELP = (
    "how much longer (a fraction of the step without it) lower-class and over-share work may "
    "make a step that carries higher-class or within-share work: more gives background work "
    "(batches, a flooding tenant) more throughput, less keeps interactive latency closer to "
    f"running alone (0..{MAX_BACKGROUND_STEP_SLACK:g})"
)


class Seated(Protocol):
    """What the policy reads of a scheduler's sequence."""

    priority: int
    tenant: str | None
    tenant_weight: float


S = TypeVar("S", bound=Seated)


def tenant_of(seq: Seated) -> str:
    return seq.tenant or DEFAULT_TENANT


@dataclass(slots=True)
class Shares:
    """Seats held and seat shares per (class, tenant) at one moment; built by `shares`."""

    held: dict[tuple[int, str], int] = field(default_factory=dict)
    share: dict[tuple[int, str], float] = field(default_factory=dict)
    # the classes with work, and per class whether some tenant in it has room (with work)
    classes: list[int] = field(default_factory=list)
    has_room_in: set[int] = field(default_factory=set)

    @property
    def is_mixed(self) -> bool:
        """Whether anyone can be outranked at all (more than one class or tenant)."""
        return len(self.share) > 1

    def is_over(self, seq: Seated) -> bool:
        key = (seq.priority, tenant_of(seq))
        return self.held.get(key, 0) >= self.share.get(key, 0.0) + 1

    def has_room(self, seq: Seated) -> bool:
        key = (seq.priority, tenant_of(seq))
        return self.held.get(key, 0) + 1 <= self.share.get(key, 0.0)

    def outranks(self, a: Seated, b: Seated) -> bool:
        """Whether `a` (waiting for a seat) comes before `b` (holding one)."""
        if a.priority != b.priority:
            return a.priority < b.priority
        return tenant_of(a) != tenant_of(b) and self.has_room(a) and self.is_over(b)

    def is_background(self, seq: Seated) -> bool:
        """Whether some sequence with work outranks running `seq`: a more urgent class has
        work, or its tenant is over its share while another tenant of its class has room."""
        if self.classes and self.classes[0] < seq.priority:
            return True
        return seq.priority in self.has_room_in and self.is_over(seq)

    def move(self, seq: Seated, num_seats: int) -> None:
        """`seq` took (+1) or gave back (-1) a seat."""
        key = (seq.priority, tenant_of(seq))
        self.held[key] = self.held.get(key, 0) + num_seats


def shares(running: Iterable[Seated], waiting: Iterable[Seated], max_num_seqs: int) -> Shares:
    """The seat shares of the tenants with work, class by class (the most urgent first)."""
    out = Shares()
    weights: dict[int, dict[str, float]] = {}
    for seq in running:
        out.move(seq, 1)
        weights.setdefault(seq.priority, {})[tenant_of(seq)] = seq.tenant_weight
    for seq in waiting:
        weights.setdefault(seq.priority, {})[tenant_of(seq)] = seq.tenant_weight
    seats = max_num_seqs
    for klass in sorted(weights):
        tenants = weights[klass]
        total = sum(max(w, 1e-6) for w in tenants.values())
        for tenant, weight in tenants.items():
            out.share[(klass, tenant)] = seats * max(weight, 1e-6) / total
        out.classes.append(klass)
        if any(out.held.get((klass, t), 0) <= out.share[(klass, t)] for t in tenants):
            out.has_room_in.add(klass)
        seats = max(seats - sum(out.held.get((klass, t), 0) for t in tenants), 0)
    return out


def victim(running: Iterable[S], needy: Seated, held: Shares) -> S | None:
    """The running sequence to preempt so that waiting `needy` gets a seat: of the least
    urgent class it outranks, the tenant furthest over its share, the youngest (last) of it;
    None when `needy` outranks nobody."""
    best: tuple[int, float, int] | None = None
    chosen: S | None = None
    for i, seq in enumerate(running):
        if not held.outranks(needy, seq):
            continue
        key = (seq.priority, tenant_of(seq))
        rank = (seq.priority, held.held.get(key, 0) / max(held.share.get(key, 0.0), 1e-6), i)
        if best is None or rank > best:
            best, chosen = rank, seq
    return chosen


def next_foreground(waiting: Sequence[Seated], held: Shares) -> int | None:
    """Index in `waiting` (queue order) of the first sequence nobody outranks, in the most
    urgent class waiting; None when every waiting one is background."""
    klass = waiting[0].priority
    for i, seq in enumerate(waiting):
        if seq.priority != klass:
            return None
        if not held.is_background(seq):
            return i
    return None


def free_a_seat(
    needy: Seated,
    running: Iterable[S],
    scheduled: Iterable[tuple[S, int]],
    held: Shares | None,
    preempt: Callable[[S], None],
) -> bool:
    """Every seat is taken and `needy` waits: preempt (`preempt`) the running sequence it
    outranks most (`victim`; none given tokens this step yet) and count its seat out of
    `held`. False when it outranks nobody, or without `held` (one class and tenant)."""
    if held is None:
        return False
    done = {id(s) for s, _ in scheduled}
    chosen = victim((s for s in running if id(s) not in done), needy, held)
    if chosen is None:
        return False
    preempt(chosen)
    held.move(chosen, -1)
    return True


class Allowance(NamedTuple):
    """What the background may add to a step: decode tokens, then prefill tokens."""

    num_decodes: int
    num_prefill_tokens: int


class AllowanceLeft:
    """What is left of an `Allowance` while a step's background sequences take from it."""

    def __init__(self, allowance: Allowance) -> None:
        self.num_decodes, self.num_prefill_tokens = allowance

    def take(self, num_left: int, num_new: int) -> int:
        """`num_new` tokens for a sequence with `num_left` to compute, cut to what is left: a
        prefill (more than one token left) draws on the prefill tokens, a decode on the
        decodes."""
        if num_left > 1:
            num_new = min(num_new, self.num_prefill_tokens)
            self.num_prefill_tokens -= num_new
        else:
            num_new = min(num_new, self.num_decodes)
            self.num_decodes -= num_new
        return num_new


def background_allowance(
    cost: Callable[[int, int], float],
    num_prefill_tokens: int,
    num_decodes: int,
    num_background_decodes: int,
    budget: int,
    slack: float = BACKGROUND_STEP_SLACK,
) -> Allowance:
    """The background's share of a step whose foreground prefills `num_prefill_tokens` and
    decodes `num_decodes` sequences: as many of its `num_background_decodes` decodes, then as
    many prefill tokens (all within `budget`), as keep `cost(prefill tokens, decodes)` (the
    step's cost; non-decreasing in both) within (1 + `slack`) x the foreground's own. The
    caller asks only when the step has foreground work."""
    limit = cost(num_prefill_tokens, num_decodes) * (1.0 + slack)
    k = _largest(
        lambda k: cost(num_prefill_tokens, num_decodes + k) <= limit,
        min(num_background_decodes, max(budget, 0)),
    )
    n = _largest(lambda n: cost(num_prefill_tokens + n, num_decodes + k) <= limit, budget - k)
    return Allowance(k, n)


def _largest(fits: Callable[[int], bool], high: int) -> int:
    """The largest n in [0, high] with `fits(n)` (`fits` true up to some n, false after)."""
    lo, hi = 0, max(high, 0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def may_overbook(
    inflight: Sequence[Seated], request: Seated, cap: int, *, is_backlogged: bool
) -> bool:
    """Whether a router may send `request` to a worker whose `inflight` requests already
    fill its `cap` seats, because that worker's engine preempts for it: its class is more
    urgent than some of that work and fewer than `cap` of the work are as urgent as it; or its
    tenant has nothing else queued (`is_backlogged` False), has room on that worker and
    another tenant there is over its share. A backlogged tenant waits for its turn in the
    router queue instead, where its fair share is kept (router/queue.py)."""
    as_urgent = sum(1 for r in inflight if r.priority <= request.priority)
    if as_urgent < len(inflight) and as_urgent < cap:
        return True
    if is_backlogged:
        return False
    held = shares(inflight, [request], cap)
    return any(held.outranks(request, r) for r in inflight)
