"""`tandem serve --engine mocker --embedding-only` as real processes (file discovery, ZMQ
events, the request plane over TCP), driven by the official `openai` SDK: the flag reaches the
worker processes, embeddings are served, generation on that model is a 400 naming it."""

from __future__ import annotations

import numpy as np
import openai
import pytest
from tests.support.services import free_port
from tests.support.tandem_procs import MODEL, start_tandem, wait_healthy, wait_instances

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


def test_embedding_only_stack_embeds_and_refuses_generation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    args = ["serve", "--engine", "mocker", "--workers", "2", "--speedup-ratio", "0"]
    args += ["--port", str(port), "--run-dir", str(tmp_path / "run"), "--embedding-only"]
    proc = start_tandem("serve", args, tmp_path)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_instances(base, lambda ids: len(ids) == 2, timeout_s=60, proc=proc)
        wait_healthy(base)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        out = client.embeddings.create(model=MODEL, input=["a b", "c"] * 4)
        vectors = np.array([d.embedding for d in out.data])
        assert vectors.shape == (8, 576)
        assert np.allclose(vectors[0], vectors[2]) and not np.allclose(vectors[0], vectors[1])
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        assert err.value.body["param"] == "model"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    finally:
        code = proc.stop()
        log = proc.log()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-5000:]
