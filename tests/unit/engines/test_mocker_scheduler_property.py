"""Property test: any interleaving of arrivals, aborts and steps keeps the scheduler and its
block pool consistent, and every request that is not aborted gets exactly max_tokens."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.scheduler import Scheduler
from tandem.errors import InvalidRequest
from tandem.protocols.engine import PreprocessedRequest, StopConditions

_add = st.tuples(
    st.just("add"),
    st.lists(st.integers(0, 3), min_size=1, max_size=20),  # tiny alphabet: many shared prefixes
    st.integers(1, 12),
)
_abort = st.tuples(st.just("abort"), st.integers(0, 40), st.just(0))
_step = st.tuples(st.just("step"), st.just(0), st.just(0))
_ops = st.lists(st.one_of(_add, _abort, _step, _step), max_size=80)


@pytest.mark.timeout(60)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops, num_blocks=st.integers(8, 20), budget=st.integers(4, 24))
def test_any_interleaving_keeps_integrity(
    ops: list[tuple[str, object, int]], num_blocks: int, budget: int
) -> None:
    sched = Scheduler(
        MockerConfig(
            num_blocks=num_blocks,
            block_size=2,
            max_num_seqs=4,
            max_num_batched_tokens=budget,
            context_length=32,
            tokenizer=None,
        )
    )
    wanted: dict[str, int] = {}
    got: dict[str, int] = {}
    finished: set[str] = set()

    def step() -> None:
        for seq, out in sched.step().outputs:
            got[seq.request_id] = got.get(seq.request_id, 0) + len(out.token_ids)
            if out.finish_reason is not None:
                finished.add(seq.request_id)
        sched.check_integrity()

    for i, (op, arg, max_tokens) in enumerate(ops):
        if op == "add":
            rid = f"r{i}"
            prompt = list(arg)  # type: ignore[call-overload]
            if len(prompt) + 1 > num_blocks * 2:  # can never fit: rejected up front
                with pytest.raises(InvalidRequest, match="KV blocks"):
                    sched.add_request(
                        PreprocessedRequest(
                            request_id=rid,
                            model="m",
                            token_ids=prompt,
                            stop=StopConditions(max_tokens=max_tokens),
                        )
                    )
                continue
            sched.add_request(
                PreprocessedRequest(
                    request_id=rid,
                    model="m",
                    token_ids=prompt,
                    stop=StopConditions(max_tokens=max_tokens),
                )
            )
            # capped by the context, and by the whole pool (a sequence alone in it stops
            # with 'length' when its computed tokens fill every block)
            wanted[rid] = min(max_tokens, 32 - len(prompt), num_blocks * 2 - len(prompt) + 1)
        elif op == "abort":
            rid = f"r{arg}"
            if sched.abort(rid) is not None:
                wanted.pop(rid, None)
            sched.check_integrity()
        else:
            step()
    for _ in range(5000):
        if not sched.has_work:
            break
        step()
    assert not sched.has_work and sched.pool.num_active_blocks == 0
    for rid, n in wanted.items():
        assert rid in finished and got[rid] == n, (rid, got.get(rid), n)
