"""`BatchLane`: the batch lane of one frontend assembled: its store, the `/v1/files` and
`/v1/batches` routes, the runner, and its metrics.

A line runs through `execute`: the app's own handler for the batch's endpoint (the same
preprocess, routing, migration and answer as an online request), called in-process with the
batch owner's tenant at the batch priority class (`RequestIdentity`), its answer captured."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from tandem.errors import ServingError
from tandem.frontend import errors as http_errors
from tandem.frontend.batch import batches, files
from tandem.frontend.batch.batches import BatchesEndpoint
from tandem.frontend.batch.config import BatchConfig
from tandem.frontend.batch.files import FilesEndpoint
from tandem.frontend.batch.runner import BatchRunner
from tandem.frontend.batch.store import BatchStore
from tandem.frontend.http.message import HttpRequest, HttpResponse
from tandem.frontend.models import ModelRegistry
from tandem.frontend.ownership import Ownership, tenant_of
from tandem.frontend.tenancy import Tenancy, current_identity
from tandem.protocols.tenancy import BATCH_PRIORITY, DEFAULT_TENANT, RequestIdentity

Handler = Callable[[HttpRequest, HttpResponse], Awaitable[None]]
STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed", "expired",
            "cancelling", "cancelled")  # fmt: skip


class BatchLane:
    """`handler_for(path)`: the app's POST handler of an endpoint (None if it has none)."""

    def __init__(
        self,
        config: BatchConfig,
        registry: ModelRegistry,
        owners: Ownership,
        handler_for: Callable[[str], Handler | None],
        tenancy: Tenancy | None = None,
    ) -> None:
        self.config, self.registry, self.tenancy = config, registry, tenancy
        self._handler_for = handler_for
        self.store = BatchStore(config.db_path)
        self.runner = BatchRunner(self.store, config, self.execute, self.busy)
        self.files = FilesEndpoint(self.store, owners, max_file_bytes=config.max_file_bytes)
        self.batches = BatchesEndpoint(
            self.store, owners, registry, max_lines=config.max_lines, on_created=self.runner.wake
        )

    def routes(self) -> dict[tuple[str, str], Handler]:
        """The exact-path routes (the id routes are `route`'s)."""
        return {
            ("POST", files.PREFIX): self.files.upload,
            ("GET", files.PREFIX): self.files.index,
            ("POST", batches.PREFIX): self.batches.create,
            ("GET", batches.PREFIX): self.batches.index,
        }

    def route(self, method: str, path: str) -> Handler | None:
        """The handler of `/v1/files/{id}[/content]` and `/v1/batches/{id}[/cancel]`, or None."""
        for prefix in (files.PREFIX + "/", batches.PREFIX + "/"):
            if not path.startswith(prefix):
                continue
            object_id, _, action = path[len(prefix) :].partition("/")
            if not object_id:
                return None
            found: Callable[[HttpRequest, HttpResponse, str], Awaitable[None]] | None
            if prefix.startswith(files.PREFIX):
                found = {("GET", ""): self.files.retrieve, ("DELETE", ""): self.files.delete,
                         ("GET", "content"): self.files.content}.get((method, action))  # fmt: skip
            else:
                found = {("GET", ""): self.batches.retrieve,
                         ("POST", "cancel"): self.batches.cancel}.get((method, action))  # fmt: skip
            if found is None:
                return None
            return _bind(found, object_id)
        return None

    def start(self) -> None:
        self.runner.start()

    async def close(self) -> None:
        await self.runner.close()
        self.store.close()

    def busy(self) -> bool:
        """Interactive traffic is waiting: a served model's router has requests queued."""
        return any(model.router.num_queued > 0 for model in self.registry.live())

    async def execute(
        self, url: str, body: bytes, owner: str, request_id: str
    ) -> tuple[int, bytes]:
        """Run one line through the app's handler for `url`; its status and JSON body."""
        handler = self._handler_for(url)
        if handler is None:
            return 404, http_errors.error_body(files.not_found("endpoint", url, "url"))
        table = self.tenancy.table if self.tenancy is not None else None
        tenant = tenant_of(owner) or (table.default_tenant if table else DEFAULT_TENANT)
        http = HttpRequest(
            method="POST", path=url, query="", body=body,
            headers={"content-type": "application/json", "x-request-id": request_id},
            http_11=False,
        )  # fmt: skip
        sink = _Sink()
        response = HttpResponse(sink, keep_alive=True, http_11=False)
        token = current_identity.set(RequestIdentity(tenant=tenant, priority=BATCH_PRIORITY))
        try:
            await handler(http, response)
        except ServingError as exc:
            return http_errors.error_status(exc), http_errors.error_body(exc)
        finally:
            current_identity.reset(token)
        head, _, payload = bytes(sink.data).partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), payload

    def summary(self) -> dict[str, Any]:
        """The dashboard's view: batches by status, each unfinished batch's lines (blocking:
        call it off the event loop)."""
        counts = self.store.status_counts()
        running = [
            {"id": batch_id, "total": total, "completed": completed, "failed": failed}
            for batch_id, total, completed, failed in self.store.progress()
        ]
        return {
            "by_status": {status: counts.get(status, 0) for status in STATUSES},
            "running": running,
            "lines_inflight": self.runner.num_inflight,
        }

    def collect(self) -> Iterable[Metric]:
        """Batches by status, and the lines of running batches (total / completed / failed)."""
        by_status = GaugeMetricFamily(
            "tandem_frontend_batches", "batches in the batch database, by status",
            labels=["status"],
        )  # fmt: skip
        counts = self.store.status_counts()
        for status in STATUSES:
            by_status.add_metric([status], counts.get(status, 0))
        yield by_status
        lines = GaugeMetricFamily(
            "tandem_frontend_batch_lines",
            "lines of each unfinished batch: total, completed (answered 200), failed",
            labels=["batch_id", "state"],
        )
        for batch_id, total, completed, failed in self.store.progress():
            for state, value in (("total", total), ("completed", completed), ("failed", failed)):
                lines.add_metric([batch_id, state], value)
        yield lines
        yield GaugeMetricFamily(
            "tandem_frontend_batch_lines_inflight", "batch lines running now",
            value=self.runner.num_inflight,
        )  # fmt: skip


def _bind(
    found: Callable[[HttpRequest, HttpResponse, str], Awaitable[None]], object_id: str
) -> Handler:
    async def handler(http: HttpRequest, response: HttpResponse) -> None:
        await found(http, response, object_id)

    return handler


class _Sink:
    """A connection that keeps what a response writes (a batch line's answer)."""

    is_draining = False
    write_blocked = False

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        return None

    def flush(self) -> None:
        return None
