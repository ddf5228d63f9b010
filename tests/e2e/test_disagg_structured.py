"""Structured output across a disaggregated pair (`tandem serve --prefill-workers 1
--decode-workers 1 --engine native`): the prefill samples the first token under the schema, the
decode worker's matcher replays it (the request's num_generated_tokens) and carries on, so the
whole answer validates — were the replay missing, the decode would restart the schema after
the first token and the text would not parse."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from tests.support.services import free_port
from tests.support.tandem_procs import MODEL, TandemProcess, start_tandem

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "sights": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 2},
    },
    "required": ["city", "days", "sights"],
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TandemProcess, str]]:
    tmp = tmp_path_factory.mktemp("disagg-structured")
    port = free_port()
    args = ["serve", "--engine", "native", "--prefill-workers", "1", "--decode-workers", "1"]
    args += ["--num-blocks", "128", "--disagg-transfer-backends", "shm,tcp"]
    args += ["--port", str(port), "--run-dir", str(tmp / "run"), "--log-level", "INFO"]
    proc = start_tandem("serve", args, tmp)
    try:
        proc.wait_log(r"tandem serve ready", timeout_s=150)
        yield proc, f"http://127.0.0.1:{port}/v1"
    finally:
        proc.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_schema_holds_across_prefill_and_decode(served, stream: bool) -> None:  # type: ignore[no-untyped-def]
    proc, base = served
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
    kw = {"model": MODEL, "max_tokens": 80, "temperature": 0.0, "response_format": fmt}
    messages = [{"role": "user", "content": "Plan a short trip. Answer in JSON."}]
    if stream:
        text = "".join(
            c.delta.content or ""
            for chunk in client.chat.completions.create(messages=messages, stream=True, **kw)
            for c in chunk.choices
        )
    else:
        resp = client.chat.completions.create(messages=messages, **kw)
        assert resp.choices[0].finish_reason == "stop"
        assert resp.usage is not None and resp.usage.completion_tokens > 3
        text = resp.choices[0].message.content or ""
    jsonschema.validate(json.loads(text), SCHEMA)
    log = proc.log()
    assert "prefilling locally" not in log, log[-3000:]
    assert "Traceback" not in log, log[-5000:]
