"""The frontend's export step of a vLLM peer fetch (`tandem.disagg.vllm_fetch`): the holder
gets the prompt head as an export request at its own address; its kv_transfer_params travel
on in the hint; a holder gone, refusing or too slow leaves the hint without an export."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tandem.disagg.vllm_fetch import needs_export, with_export
from tandem.engines.vllm.peer_fetch import EXPORT_S_KEY, PROTOCOL, is_export
from tandem.engines.vllm.sampling import VLLM_PARAMS_KEY
from tandem.errors import PeerGone
from tandem.protocols.engine import (
    EngineOutput,
    KvFetchHint,
    PreprocessedRequest,
    StopConditions,
    decode_request,
    encode,
)

pytestmark = pytest.mark.timeout(10)
B = 16
HINT = KvFetchHint(source_instance_id="A", address=("127.0.0.1", 1), agent_id="a",
                   block_hashes=[1, 2], block_size=B, protocol=PROTOCOL,
                   source_address="tcp://holder:1")  # fmt: skip
REQUEST = PreprocessedRequest(request_id="r", model="m", token_ids=list(range(3 * B)),
                              stop=StopConditions(max_tokens=8), deadline_s=1e12)  # fmt: skip


class Client:
    def __init__(self, outputs: list[EngineOutput], error: Exception | None = None,
                 hang: bool = False) -> None:  # fmt: skip
        self.outputs, self.error, self.hang = outputs, error, hang
        self.sent: list[tuple[str, str, PreprocessedRequest]] = []

    def stream(self, address: str, path: str, payload: bytes, *, request_id: str,
               deadline_s: float | None = None) -> AsyncIterator[bytes]:  # fmt: skip
        self.sent.append((address, path, decode_request(payload)))
        return self._payloads()

    async def _payloads(self) -> AsyncIterator[bytes]:
        if self.hang:
            await asyncio.sleep(60)
        if self.error is not None:
            raise self.error
        for out in self.outputs:
            yield encode(out)


async def test_the_holder_exports_and_its_params_ride_the_hint() -> None:
    params = {VLLM_PARAMS_KEY: {"remote_block_ids": [4, 5]}, "start_by_s": 1e12}
    client = Client([EngineOutput(finish_reason="stop", disagg_params=params)])
    assert needs_export(HINT)
    hint = await with_export(client, "t.backend.generate", REQUEST, HINT)  # type: ignore[arg-type]
    ((address, path, sent),) = client.sent
    assert (address, path) == ("tcp://holder:1", "t.backend.generate")
    assert is_export(sent) and sent.token_ids == REQUEST.token_ids[: 2 * B + 1]
    assert hint.export is not None and hint.export[VLLM_PARAMS_KEY] == params[VLLM_PARAMS_KEY]
    assert hint.export[EXPORT_S_KEY] >= 0 and not needs_export(hint)


@pytest.mark.parametrize(
    "client",
    [
        Client([], error=PeerGone("connection refused")),
        Client([EngineOutput(finish_reason="error", error="vLLM returned no params")]),
        Client([]),
    ],
)
async def test_a_holder_that_cannot_export_leaves_the_hint_without_one(client: Client) -> None:
    hint = await with_export(client, "p", REQUEST, HINT)  # type: ignore[arg-type]
    assert hint.export is None and hint.source_instance_id == "A"


async def test_a_slow_holder_is_given_up_at_the_timeout() -> None:
    hint = await with_export(Client([], hang=True), "p", REQUEST, HINT, timeout_s=0.05)  # type: ignore[arg-type]
    assert hint.export is None
