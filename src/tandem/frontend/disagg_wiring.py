"""The frontend's side of disaggregation (DESIGN §4): the two-leg streamer over the decode
pool and its prefill pool, built from the frontend's config and runtime (imported only when
`--disagg` is on: disaggregation's modules stay out of an aggregated frontend)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from tandem.frontend.config import FrontendConfig
from tandem.frontend.migration import EngineStreamer
from tandem.router.registry import make_router
from tandem.runtime.instances import InstanceSet
from tandem.runtime.runtime import Runtime

if TYPE_CHECKING:
    from tandem.disagg.orchestrator import DisaggStreamer
    from tandem.disagg.pool import PrefillPool


def disagg_streamer(
    config: FrontendConfig,
    runtime: Runtime,
    aggregated: EngineStreamer,
    workers: InstanceSet,
    prefill: InstanceSet | None = None,
) -> tuple[DisaggStreamer, PrefillPool]:
    """The two-leg streamer and its prefill pool (started by the caller) over `prefill`
    (default: a new InstanceSet of the prefill component)."""
    from tandem.disagg.orchestrator import DisaggStreamer
    from tandem.disagg.pool import PrefillPool

    dc = config.disagg
    # a busy prefill pool never queues a prompt: the decode worker prefills it (DESIGN §4)
    router_config = dataclasses.replace(
        config.router, worker_component=dc.prefill_component, queue_size=0
    )
    pool = PrefillPool(
        prefill or runtime.instance_set(dc.prefill_component, config.worker_endpoint),
        lambda view: make_router(
            config.router_policy,
            router_config,
            instances=view,
            events=runtime.events,
            client=runtime.client,
            discovery=runtime.discovery,
            namespace=runtime.namespace,
        ),
    )
    path = runtime.endpoint_path(dc.prefill_component, config.worker_endpoint)
    streamer = DisaggStreamer(aggregated, pool, workers, runtime.client, path, dc,
                              cluster_secret=runtime.config.cluster_secret,
                              transfer_tls=runtime.config.tls)  # fmt: skip
    return streamer, pool
