"""Admission: the frontend's bound on engine requests in flight (every queue is bounded).

A request takes one slot per engine request it fans out to (prompts × n, or 1 for an
embeddings call) before any await, so concurrent arrivals cannot overshoot the bound while
they preprocess; it gives them back when it ends."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tandem.errors import InvalidRequest, Overloaded
from tandem.protocols.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    fan_out,
    num_candidates,
)


class Admission:
    """The in-flight slots of one frontend; one event loop."""

    def __init__(self, *, max_inflight: int, max_fanout: int, retry_after_s: float) -> None:
        self.max_inflight = max_inflight
        self.max_fanout = max_fanout
        self.retry_after_s = retry_after_s
        self.num_inflight = 0  # engine requests admitted (a request counts its fan-out)

    def fan_out(self, req: ChatCompletionRequest | CompletionRequest) -> int:
        """How many engine requests `req` fans out to (prompts × n); raises InvalidRequest past
        the per-request cap."""
        num = fan_out(req)
        cap = min(self.max_fanout, self.max_inflight)
        if num > cap:
            per_prompt = num_candidates(req)
            what = f"best_of={per_prompt}" if req.best_of is not None else f"n={req.n}"
            prompts = "1 prompt" if num == per_prompt else f"{num // per_prompt} prompts"
            raise InvalidRequest(
                f"request fans out to {num} engine requests ({prompts} × {what}); "
                f"at most {cap} per request (--max-fanout {self.max_fanout}, "
                f"--max-inflight-requests {self.max_inflight}); split it or lower n",
                param=what.split("=")[0] if num == per_prompt else "prompt",
            )
        return num

    @contextmanager
    def slots(self, num: int) -> Iterator[None]:
        """Hold `num` slots for the block; raises Overloaded (503 + Retry-After) when they are
        not free."""
        if self.num_inflight + num > self.max_inflight:
            raise Overloaded(
                f"{self.num_inflight} engine requests in flight + {num} asked exceeds the limit "
                f"{self.max_inflight}; retry later",
                retry_after_s=self.retry_after_s,
            )
        self.num_inflight += num
        try:
            yield
        finally:
            self.num_inflight -= num
