"""`tandem serve --prefill-workers 1 --decode-workers 1 --engine native` as real processes:
completions over HTTP equal the aggregated engine's greedy tokens, the KV went through the
shared-memory backend, and the prefill worker being SIGKILLed with pins outstanding still
ends every request (the decode prefills locally)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import Iterator

import openai
import pytest
from tests.support.services import free_port
from tests.support.tandem_procs import MODEL, TandemProcess, start_tandem

from tandem.engines.native.config import NativeConfig
from tandem.engines.native.engine import NativeEngine
from tandem.protocols.engine import PreprocessedRequest, SamplingParams, StopConditions
from tandem.tokens.tokenizer import load_tokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
PROMPTS = [[1, 9690, 314, 253, 1345, 30], list(range(300, 341)), list(range(1000, 1100, 3))]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TandemProcess, str]]:
    tmp = tmp_path_factory.mktemp("disagg")
    port = free_port()
    args = ["serve", "--engine", "native", "--prefill-workers", "1", "--decode-workers", "1"]
    args += ["--num-blocks", "64", "--disagg-transfer-backends", "shm,tcp", "--decode-fallback"]
    args += ["--port", str(port), "--run-dir", str(tmp / "run"), "--log-level", "INFO"]
    proc = start_tandem("serve", args, tmp)
    try:
        proc.wait_log(r"tandem serve ready", timeout_s=90)
        yield proc, f"http://127.0.0.1:{port}/v1"
    finally:
        proc.stop()


def reference() -> list[list[int]]:
    async def run() -> list[list[int]]:
        engine = NativeEngine(NativeConfig(num_blocks=64))
        await engine.start()
        out = []
        for i, prompt in enumerate(PROMPTS):
            req = PreprocessedRequest(
                request_id=f"ref{i}", model=MODEL, token_ids=prompt,
                sampling=SamplingParams(temperature=0.0),
                stop=StopConditions(max_tokens=MAX_TOKENS, ignore_eos=True),
            )  # fmt: skip
            out.append([t async for o in engine.generate(req) for t in o.token_ids])
        await engine.stop()
        return out

    return asyncio.run(run())


def test_disagg_serve_matches_aggregated_then_survives_prefill_kill(served) -> None:
    proc, base = served
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0)

    def complete(prompt: list[int]) -> str:
        resp = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert resp.choices[0].finish_reason == "length"
        assert resp.usage is not None and resp.usage.completion_tokens == MAX_TOKENS
        return resp.choices[0].text

    got = [complete(p) for p in PROMPTS]
    tok = load_tokenizer(_gguf())
    assert got == [tok.decode(ids) for ids in reference()]
    log = proc.log()
    assert re.search(r"backend=shm", log), log[-3000:]
    assert "prefilling locally" not in log

    pid = int(re.findall(r"started prefill0 pid=(\d+)", log)[0])
    os.kill(pid, signal.SIGKILL)  # the prefill dies; requests still complete
    assert [complete(p) for p in PROMPTS[:1]] == got[:1]


def _gguf() -> str:
    from tandem.engines.mocker.config import default_tokenizer

    path = default_tokenizer()
    assert path is not None
    return path
