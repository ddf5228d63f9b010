"""`tandem serve --engine mocker --workers 2` as a real process, driven by the official `openai`
SDK (issue 2, "How it is shown"): chat stream with usage, completions, n=2, stop strings,
400 for a bad field, 404 for an unknown model, /metrics, /health and /v1/route/explain."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from tests.support.services import free_port
from tests.support.tandem_procs import (
    MODEL,
    TandemProcess,
    http_request,
    start_tandem,
    wait_healthy,
    wait_instances,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


class Served:
    def __init__(self, proc: TandemProcess, base_url: str, instance_ids: set[str]) -> None:
        self.proc, self.base_url, self.instance_ids = proc, base_url, instance_ids
        self.client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)


ADMIN_KEY = "admin-e2e-key"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("serve")
    port = free_port()
    args = ["serve", "--engine", "mocker", "--workers", "2", "--speedup-ratio", "0"]
    args += ["--port", str(port), "--run-dir", str(tmp / "run"), "--log-level", "INFO"]
    args += ["--admin-api-key", ADMIN_KEY]
    proc = start_tandem("serve", args, tmp)
    try:
        base = f"http://127.0.0.1:{port}"
        ids = wait_instances(base, lambda ids: len(ids) == 2, timeout_s=45, proc=proc)
        wait_healthy(base)  # tokenizer loaded, load metrics arriving
        yield Served(proc, base, ids)
    finally:
        code = proc.stop()
        log = proc.log()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-5000:]


def _chat(**kw: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], **kw}


def test_models_and_health(served: Served) -> None:
    assert [m.id for m in served.client.models.list().data] == [MODEL]
    status, _, body = http_request(f"{served.base_url}/health")
    assert status == 200
    assert set(json.loads(body)["instances"][MODEL]) == served.instance_ids
    assert http_request(f"{served.base_url}/live")[0] == 200


def test_chat_stream_with_usage(served: Served) -> None:
    stream = served.client.chat.completions.create(
        **_chat(max_tokens=16, stream=True, stream_options={"include_usage": True})
    )
    text, finishes, usage, roles = "", [], None, []
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for choice in chunk.choices:
            roles += [choice.delta.role] if choice.delta.role else []
            text += choice.delta.content or ""
            finishes += [choice.finish_reason] if choice.finish_reason else []
    assert roles == ["assistant"]
    assert finishes == ["length"]
    assert text.strip()
    assert usage is not None
    assert usage.completion_tokens == 16
    assert usage.prompt_tokens > 5  # the chat template wraps the message
    assert usage.total_tokens == usage.prompt_tokens + 16
    assert usage.prompt_tokens_details.cached_tokens is not None


def test_completions_text_and_token_ids(served: Served) -> None:
    out = served.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=9)
    [choice] = out.choices
    assert choice.finish_reason == "length" and choice.text
    assert out.usage.completion_tokens == 9
    ids = served.client.completions.create(model=MODEL, prompt=[101, 102, 103], max_tokens=4)
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 4


def test_completions_n2(served: Served) -> None:
    out = served.client.completions.create(model=MODEL, prompt="Hello", max_tokens=7, n=2)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(c.finish_reason == "length" and c.text for c in out.choices)
    assert out.usage.completion_tokens == 14
    chat = served.client.chat.completions.create(**_chat(max_tokens=5, n=2))
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.usage.completion_tokens == 10


def test_stop_strings_streamed_and_not(served: Served) -> None:
    # the mocker's tokens are a pure function of the seed: learn the text, then stop inside it
    kw = {"model": MODEL, "prompt": "Count:", "max_tokens": 40, "seed": 1234}
    full = served.client.completions.create(**kw).choices[0].text
    assert len(full) > 40, full
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    expected = full[: full.index(stop)]
    out = served.client.completions.create(**kw, stop=[stop])
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    stream = served.client.completions.create(**kw, stop=stop, stream=True)
    pieces = [(c.choices[0].text, c.choices[0].finish_reason) for c in stream if c.choices]
    assert "".join(text for text, _ in pieces) == expected
    assert pieces[-1][1] == "stop"


def test_bad_field_is_400_naming_it(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        served.client.chat.completions.create(**_chat(max_tokens=4), extra_body={"n": "two"})
    assert err.value.status_code == 400
    assert err.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as err:
        served.client.completions.create(model=MODEL, prompt="x", max_tokens=-3)
    assert "max_tokens" in err.value.message


def test_unknown_model_is_404(served: Served) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        served.client.chat.completions.create(**{**_chat(max_tokens=4), "model": "gpt-5"})
    assert err.value.status_code == 404
    assert err.value.body["code"] == "model_not_found"
    assert MODEL in err.value.message


def test_metrics_after_traffic(served: Served) -> None:
    served.client.completions.create(model=MODEL, prompt="metrics", max_tokens=3)
    status, headers, body = http_request(f"{served.base_url}/metrics")
    assert status == 200
    assert headers["content-type"].startswith("text/plain")
    text = body.decode()
    assert (
        'tandem_frontend_requests_total{model="smollm2",endpoint="completions",'
        'request_type="unary",status="success",status_code="200"}' in text
    )
    assert "tandem_frontend_time_to_first_token_seconds_count" in text
    for iid in served.instance_ids:  # per-worker load as the router sees it
        assert f'tandem_frontend_worker_load{{model="smollm2",worker_id="{iid}"' in text
    assert "tandem_router_" in text  # the router's own metrics are appended


def test_route_explain(served: Served) -> None:
    url = f"{served.base_url}/v1/route/explain"
    status, _, raw = http_request(url, _chat(max_tokens=4))
    assert status == 401, raw  # an admin route: admin key only
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    status, _, raw = http_request(url, _chat(max_tokens=4), headers=auth)
    assert status == 200, raw
    body = json.loads(raw)
    assert body["policy"] == "round_robin"
    assert {c["worker_id"] for c in body["candidates"]} == served.instance_ids
