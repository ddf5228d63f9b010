"""`WorkerScraper`: the frontend's `GET /metrics/workers` and `/metrics/workers/{worker_id}`.

Every worker answers its Prometheus text on its `metrics` request-plane endpoint (named in
its discovery record as `metrics_endpoint`), so one scrape of the frontend covers the workers
of `tandem serve` without a port per worker. The workers are asked concurrently, each within
`timeout_s`; their expositions are merged into one (every worker series is labelled with
`worker_id`, `component` and `model`), and `tandem_worker_up{worker_id,component}` says which
answered (0: it timed out or failed; its series are absent from this scrape).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from tandem.errors import InvalidRequest
from tandem.protocols.discovery import Instance
from tandem.runtime.base import Discovery, RequestClient
from tandem.runtime.metrics import merge

logger = logging.getLogger(__name__)

UP_HELP = "# HELP tandem_worker_up 1 if the worker answered this scrape, else 0"


class WorkerScraper:
    """Stateless between scrapes; safe for concurrent scrapes on one event loop."""

    def __init__(
        self,
        discovery: Discovery,
        client: RequestClient,
        namespace: str,
        *,
        timeout_s: float = 2.0,
    ) -> None:
        self._discovery, self._client = discovery, client
        self._namespace, self._timeout_s = namespace, timeout_s

    async def workers(self) -> list[Instance]:
        """Live instances that serve metrics, one per worker id, sorted by id."""
        found = await self._discovery.list_instances(f"{self._namespace}.")
        by_id = {i.instance_id: i for i in found if i.metadata.get("metrics_endpoint")}
        return [by_id[k] for k in sorted(by_id)]

    async def scrape(self, worker_id: str | None = None) -> bytes:
        """Merged text of every worker (or of `worker_id` alone; InvalidRequest 404 when no
        such worker serves metrics)."""
        workers = await self.workers()
        if worker_id is not None:
            workers = [w for w in workers if w.instance_id == worker_id]
            if not workers:
                err = InvalidRequest(
                    f"no worker '{worker_id}' serves metrics; see /metrics/workers"
                )
                err.status_code = 404
                raise err
        texts = await asyncio.gather(*(self._one(w) for w in workers))
        up = [UP_HELP, "# TYPE tandem_worker_up gauge"]
        for w, text in zip(workers, texts, strict=True):
            labels = f'worker_id="{w.instance_id}",component="{w.component}"'
            up.append(f"tandem_worker_up{{{labels}}} {0 if text is None else 1}")
        parts = [*(t for t in texts if t is not None), "\n".join(up) + "\n"]
        # parsing and merging take ~8 ms per worker here: off the event loop that streams tokens
        return await asyncio.to_thread(merge, parts)

    async def _one(self, worker: Instance) -> str | None:
        path = f"{worker.namespace}.{worker.component}.{worker.metadata['metrics_endpoint']}"
        try:
            async with asyncio.timeout(self._timeout_s):
                stream = self._client.stream(
                    worker.address,
                    path,
                    b"",
                    request_id=f"metrics-{uuid.uuid4().hex[:12]}",
                    deadline_s=time.time() + self._timeout_s,
                )
                chunks = [bytes(chunk) async for chunk in stream]
        except Exception as exc:  # a scrape boundary: this worker is down for this scrape
            logger.warning("metrics of worker %s at %s: %r", worker.instance_id, path, exc)
            return None
        return b"".join(chunks).decode()
