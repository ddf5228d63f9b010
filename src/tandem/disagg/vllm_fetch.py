"""The frontend's part in a peer KV fetch between vLLM workers (issue 31): step 1, the export.

vLLM exports KV only as a request on the holder (`tandem.engines.vllm.peer_fetch` has the
three steps), so before the chosen worker gets a request whose `kv_fetch` hint has protocol
``vllm-nixl``, the frontend sends the holder the export request over the request plane,
as it sends a vLLM prefill worker its leg in 1P1D, and hands the holder's
kv_transfer_params on in the hint's ``export``. The fetcher has no request-plane client of
its own and vLLM moves the bytes itself, so the frontend, which dials every worker already,
is the one place that can ask the holder.

Whatever fails (the holder gone, busy past ``timeout_s``, refusing) sends the hint on with
no export: the fetcher counts the fetch as given up and computes the prompt.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import msgspec

from tandem.engines.vllm.peer_fetch import (
    EXPORT_S_KEY,
    PROTOCOL,
    export_request,
    last_output,
    usable,
)
from tandem.errors import ServingError
from tandem.protocols.engine import (
    EngineOutput,
    KvFetchHint,
    PreprocessedRequest,
    decode_output,
    encode,
)
from tandem.runtime.base import RequestClient

logger = logging.getLogger(__name__)
# the most the holder may take to export (one token's pass behind its running batch): past
# it the fetcher computes the prompt, as a slow pull would
EXPORT_TIMEOUT_S = 5.0


def needs_export(hint: KvFetchHint | None) -> bool:
    """Whether the frontend must ask the hint's holder to export before dispatching."""
    return hint is not None and hint.protocol == PROTOCOL and hint.export is None


async def with_export(
    client: RequestClient,
    endpoint_path: str,
    request: PreprocessedRequest,
    hint: KvFetchHint,
    *,
    timeout_s: float = EXPORT_TIMEOUT_S,
) -> KvFetchHint:
    """The hint with the holder's export (step 1), or with none when it could not export."""
    if hint.source_address is None or not usable(request, hint):
        return hint
    started = time.monotonic()
    step = export_request(request, hint)
    try:
        async with asyncio.timeout(timeout_s):
            last = await last_output(
                _outputs(client, hint.source_address, endpoint_path, step, request)
            )
    except (ServingError, TimeoutError, OSError) as exc:
        logger.info("request_id=%s: holder %s did not export the prefix (%s); the fetcher "
                    "computes it", request.request_id, hint.source_instance_id,
                    exc or type(exc).__name__)  # fmt: skip
        return hint
    if last is None or last.finish_reason != "stop" or not last.disagg_params:
        reason = "no output" if last is None else last.error or last.finish_reason or "no end"
        logger.info("request_id=%s: holder %s exported nothing (%s)", request.request_id,
                    hint.source_instance_id, reason)  # fmt: skip
        return hint
    export = {**last.disagg_params, EXPORT_S_KEY: time.monotonic() - started}
    return msgspec.structs.replace(hint, export=export)


async def _outputs(
    client: RequestClient,
    address: str,
    endpoint_path: str,
    step: PreprocessedRequest,
    request: PreprocessedRequest,
) -> AsyncIterator[EngineOutput]:
    stream = client.stream(address, endpoint_path, encode(step), request_id=step.request_id,
                           deadline_s=request.deadline_s)  # fmt: skip
    try:
        async for payload in stream:
            yield decode_output(payload)
    finally:
        await stream.aclose()
