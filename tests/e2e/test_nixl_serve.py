"""`tandem serve` E/P/D with every transfer over NIXL (UCX between the processes on 127.0.0.1):
the prefill worker's KV reaches the decode worker, and the encode worker's image embeddings
reach the prefill worker, through `--disagg-transfer-backends nixl,tcp` and
`--mm-transfer-backends nixl,tcp`. Text completions equal the aggregated engine's greedy tokens
(the reference the shm path is held to in test_disagg_serve.py); an answer about a photo equals
the one the same worker gives when it encodes the photo itself (encoder killed, prefix caching
off, so nothing computed from the NIXL bytes is reused)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Iterator

import openai
import pytest
from tests.e2e.test_disagg_serve import MAX_TOKENS, PROMPTS, reference
from tests.e2e.test_multimodal_topologies import FIRST, Stack
from tests.support.optional import require
from tests.support.services import free_port
from tests.support.tandem_procs import MODEL, start_tandem

from tandem.tokens.tokenizer import load_tokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]
NIXL = "nixl,tcp"  # tcp only where nixl cannot reach the peer, which the log would say


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require("nixl", "make venv installs nixl==1.5.1")
    tmp = tmp_path_factory.mktemp("nixl")
    port = free_port()
    args = ["serve", "--engine", "native", "--port", str(port), "--run-dir", str(tmp / "run")]
    args += ["--encode-workers", "1", "--prefill-workers", "1", "--decode-workers", "1"]
    args += ["--disagg-min-prefill-tokens", "1", "--disagg-transfer-backends", NIXL]
    args += ["--mm-transfer-backends", NIXL, "--encoder-args", f"--mm-transfer-backends {NIXL}"]
    args += ["--mm-embedding-cache-mb", "0", "--no-prefix-caching", "--num-blocks", "256"]
    args += ["--max-num-seqs", "4", "--log-level", "INFO"]
    proc = start_tandem("serve", args, tmp)
    try:
        proc.wait_log(r"tandem serve ready", timeout_s=300)
        yield Stack(proc, port, tmp / "run")
    finally:
        pids = re.findall(r"started \w+ pid=(\d+)", proc.log())
        proc.stop()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _pulled_over_nixl_from(log: str, role: str) -> bool:
    """Whether an agent logged pulling from the agent of process `role` (agent ids are
    host-pid-random) with the nixl backend."""
    [pid] = re.findall(rf"started {role}\d+ pid=(\d+)", log)
    return re.search(rf"peer=\S+-{pid}-\w+ backend=nixl\b", log) is not None


def test_kv_over_nixl_equals_the_aggregated_engine(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0)
    got = []
    for prompt in PROMPTS:
        resp = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert resp.usage is not None and resp.usage.completion_tokens == MAX_TOKENS
        got.append(resp.choices[0].text)
    log = stack.proc.log()
    assert _pulled_over_nixl_from(log, "prefill"), log[-4000:]
    assert "FALLBACK" not in log and "prefilling locally" not in log, log[-4000:]
    tok = load_tokenizer(_gguf())
    assert got == [tok.decode(ids) for ids in reference()]


def test_image_embeddings_over_nixl_equal_a_local_encode(stack: Stack) -> None:
    remote = stack.answer("chelsea.png", FIRST)
    log = stack.proc.log()
    assert _pulled_over_nixl_from(log, "encoder"), log[-4000:]
    assert "encoding locally" not in log
    assert "cat" in remote.lower(), remote
    for pid in stack.encoder_pids():
        os.kill(pid, signal.SIGKILL)
    local = stack.answer("chelsea.png", FIRST)  # the prefill worker encodes it now
    assert "encoding locally" in stack.proc.log()
    assert local == remote


def _gguf() -> str:
    from tandem.engines.mocker.config import default_tokenizer

    path = default_tokenizer()
    assert path is not None
    return path
