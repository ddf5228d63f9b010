"""The worker's spans of one request (tracing on only; `tandem.runtime.tracing`).

`worker.generate` is the child of the caller's span (the request plane's `traceparent`);
under it `prefill` runs from arrival to the first output with tokens, and `decode` from
there to the last output. A decode worker that receives the prompt's KV from a prefill
worker has no `prefill` span: its `kv_transfer` span (`tandem.disagg.decode`) covers the
wait instead, and `decode` starts at its first output.
"""

from __future__ import annotations

from typing import Any

from tandem.protocols.engine import EngineOutput, PreprocessedRequest
from tandem.runtime import tracing


class WorkerSpans:
    """Spans of one request on one worker; one task, not thread-safe."""

    __slots__ = ("_decode", "_prefill", "_root", "_use")

    def __init__(
        self, request: PreprocessedRequest, traceparent: str | None, worker_id: str, role: str
    ) -> None:
        self._root = tracing.start(
            "worker.generate",
            parent=traceparent,
            kind=tracing.SERVER,
            request_id=request.request_id,
            worker_id=worker_id,
            role=role,
            model=request.model,
            prompt_tokens=request.num_prompt_tokens,
        )
        has_kv = request.disagg_params is not None and role == "decode"
        self._prefill = None if has_kv else tracing.start("prefill", parent=self._root)
        self._decode: Any = None
        # the engine's own spans (kv_transfer) are children of worker.generate
        self._use = tracing.use(self._root)
        self._use.__enter__()

    def output(self, out: EngineOutput) -> None:
        if self._decode is None and out.token_ids:
            if self._prefill is not None:
                tracing.end(self._prefill, num_cached_tokens=out.num_cached_tokens)
                self._prefill = None
            if out.finish_reason is None:
                self._decode = tracing.start("decode", parent=self._root)
        if out.finish_reason is not None:
            self.finish(None, out.finish_reason)

    def finish(self, error: BaseException | None, finish_reason: str | None = None) -> None:
        """End what is open (idempotent); `error` marks the spans failed."""
        if self._root is None:
            return
        tracing.end(self._prefill, error)
        tracing.end(self._decode, error)
        tracing.end(self._root, error, finish_reason=finish_reason)
        self._prefill = self._decode = self._root = None
        self._use.__exit__(None, None, None)
