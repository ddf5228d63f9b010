"""What `VllmEngine.generate` hands to vLLM's `AsyncLLM.generate` (vLLM itself is not in this
venv: a recording stand-in takes its place, and the vLLM-importing mappers are stubbed; the real
engine is tests/e2e/test_vllm_serve.py): the request's priority class (issue 33; vLLM's
convention, lower = served earlier) and its adapter's LoRARequest."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from tandem.engines.base import EngineInfo
from tandem.engines.vllm import engine as vllm_engine
from tandem.engines.vllm.config import VllmWorkerConfig
from tandem.engines.vllm.engine import VllmEngine
from tandem.protocols.engine import PreprocessedRequest, StopConditions
from tandem.protocols.tenancy import PRIORITY_CLASSES


class RecordingLLM:
    """AsyncLLM's `generate` as far as the engine uses it: records its arguments, streams one
    finished output."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        self.calls.append((args, kwargs))
        return self._stream()

    async def _stream(self) -> AsyncIterator[Any]:
        completion = SimpleNamespace(token_ids=[7], finish_reason="length", logprobs=None)
        yield SimpleNamespace(outputs=[completion], num_cached_tokens=0)

    async def abort(self, request_id: str) -> None:
        raise AssertionError(f"{request_id} finished; nothing to abort")


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> VllmEngine:
    monkeypatch.setattr(vllm_engine, "sampling_params", lambda r, **_: SimpleNamespace())
    monkeypatch.setattr(vllm_engine, "tokens_prompt", lambda r: list(r.token_ids))
    eng = VllmEngine(VllmWorkerConfig(engine_args={"enable_lora": True}))
    eng.llm = RecordingLLM()
    eng._info = EngineInfo(model_name="m", context_length=256, block_size=16, num_total_blocks=64,
                           max_num_seqs=8, max_num_batched_tokens=64)  # fmt: skip

    async def unguarded(stream: AsyncIterator[Any], request_id: str) -> AsyncIterator[Any]:
        async for out in stream:  # the real one maps vLLM's exception types
            yield out

    eng._guarded = unguarded  # type: ignore[method-assign]
    return eng


def _request(priority: int, lora_name: str | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=f"r{priority}", model="m", token_ids=[1, 2, 3], priority=priority,
        lora_name=lora_name, stop=StopConditions(max_tokens=1),
    )  # fmt: skip


@pytest.mark.parametrize("priority", sorted(PRIORITY_CLASSES.values()))
async def test_the_request_class_reaches_vllm_as_its_priority(
    engine: VllmEngine, priority: int
) -> None:
    outs = [o async for o in engine.generate(_request(priority))]
    assert outs[-1].token_ids == [7] and outs[-1].finish_reason == "length"
    ((args, kwargs),) = engine.llm.calls
    assert args == ([1, 2, 3], args[1], f"r{priority}")
    assert kwargs == {"lora_request": None, "priority": priority}


async def test_an_adapter_request_carries_its_lora_request_and_class(engine: VllmEngine) -> None:
    held = SimpleNamespace(lora_name="a1", lora_int_id=1, lora_path="/adapters/a1")
    engine._loras["a1"] = held
    [o async for o in engine.generate(_request(PRIORITY_CLASSES["batch"], lora_name="a1"))]
    ((_, kwargs),) = engine.llm.calls
    assert kwargs == {"lora_request": held, "priority": PRIORITY_CLASSES["batch"]}
