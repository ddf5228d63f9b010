from __future__ import annotations

import os

import pytest

from tandem.bench.loadgen import LoadConfig, run_load
from tandem.bench.report import summarize
from tandem.bench.workload import RequestSpec

pytestmark = pytest.mark.timeout(20)


def _specs(n: int, prompt_len: int = 10) -> list[RequestSpec]:
    return [
        RequestSpec(token_ids=list(range(100, 100 + prompt_len)), max_tokens=4) for _ in range(n)
    ]


async def test_ttft_itl_and_cached_tokens_are_measured(fake_openai):
    url = f"http://127.0.0.1:{fake_openai.port}"
    config = LoadConfig(url=url, concurrency=2, num_requests=4)
    run = await run_load(config, _specs(4))
    assert run.model == "fake-model"  # default: first of /v1/models
    assert len(run.results) == 4 and all(r.ok for r in run.results)
    for r in run.results:
        # the text-less role chunk does not count: TTFT waits for the first text
        assert r.ttft_s is not None and r.ttft_s >= fake_openai.first_token_delay_s * 0.9
        assert len(r.itl_s) == fake_openai.num_tokens - 1
        # each chunk leaves token_gap_s after the last; a client descheduled on a busy host
        # reads two in one go (a gap near 0, the next one longer), so the gaps hold in sum
        assert all(gap >= 0 for gap in r.itl_s)
        assert sum(r.itl_s) >= fake_openai.token_gap_s * len(r.itl_s) * 0.9
        assert r.e2e_s >= r.ttft_s + sum(r.itl_s) * 0.99
        assert (r.prompt_tokens, r.output_tokens, r.cached_tokens) == (10, 4, 5)
        assert r.saw_done
    summary = summarize(run)
    assert summary["cached_fraction"] == pytest.approx(0.5)
    assert summary["num_errors"] == 0
    assert summary["ttft_ms"]["p50"] >= fake_openai.first_token_delay_s * 900
    body = fake_openai.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["prompt"] == list(range(100, 110)) and body["ignore_eos"] is True


async def test_reused_connections_vs_fresh(fake_openai):
    url = f"http://127.0.0.1:{fake_openai.port}"
    fake_openai.first_token_delay_s = fake_openai.token_gap_s = 0.0
    await run_load(LoadConfig(url=url, concurrency=2, num_requests=10), _specs(10))
    assert len(fake_openai.peers) <= 2  # keep-alive pool: one connection per in-flight slot
    fake_openai.peers.clear()
    run = await run_load(
        LoadConfig(url=url, concurrency=2, num_requests=10, fresh_connections=True), _specs(10)
    )
    assert all(r.ok for r in run.results)
    assert len(fake_openai.peers) == 10


async def test_errors_are_counted_by_status(fake_openai):
    url = f"http://127.0.0.1:{fake_openai.port}"
    run = await run_load(LoadConfig(url=url, model="bad", num_requests=3), _specs(3))
    summary = summarize(run)
    assert summary["num_ok"] == 0 and summary["errors_by_status"] == {"400": 3}
    assert "bad model" in summary["error_samples"][0]


async def test_connection_refused_is_status_zero(fake_openai):
    url = f"http://127.0.0.1:{fake_openai.port}"
    await fake_openai.stop()
    run = await run_load(LoadConfig(url=url, model="m", num_requests=2), _specs(2))
    assert [r.status for r in run.results] == [0, 0]
    assert summarize(run)["errors_by_status"] == {"0": 2}


async def test_chat_endpoint_and_request_rate(fake_openai):
    url = f"http://127.0.0.1:{fake_openai.port}"
    fake_openai.first_token_delay_s = fake_openai.token_gap_s = 0.0
    config = LoadConfig(url=url, endpoint="chat", request_rate=500.0, num_requests=6)
    run = await run_load(config, _specs(6, prompt_len=7))
    assert all(r.ok and r.ttft_s is not None for r in run.results)
    assert len(fake_openai.bodies[0]["messages"][0]["content"].split()) == 7
    starts = sorted(r.start_s for r in run.results)
    assert starts[-1] > starts[0]  # spread over time, not all at once


async def test_server_cpu_is_measured_per_pid(fake_openai):
    url = f"http://127.0.0.1:{fake_openai.port}"
    fake_openai.first_token_delay_s = fake_openai.token_gap_s = 0.0
    fake_openai.cpu_burn_s = 0.002
    config = LoadConfig(url=url, concurrency=4, num_requests=40, server_pids=(os.getpid(),))
    run = await run_load(config, _specs(40))
    # the fake server runs in this process and burns >= 2 ms CPU per request
    assert run.server_cpu_s[os.getpid()] >= 0.06
    assert summarize(run)["server_cpu_ms_per_request"][str(os.getpid())] >= 1.5


async def test_trace_replay_sends_at_timestamps_with_exact_prompts(fake_openai, tmp_path):
    import json

    from tandem.bench.trace import TraceConfig, trace_requests

    fake_openai.first_token_delay_s = fake_openai.token_gap_s = 0.0
    path = tmp_path / "trace.jsonl"
    records = [
        {"timestamp": 0, "input_length": 6, "output_length": 3, "hash_ids": [1, 2]},
        {"timestamp": 200, "input_length": 8, "output_length": 2, "hash_ids": [1, 3]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    specs = trace_requests(path, TraceConfig(block_size=4, vocab_size=100, speedup=2.0))
    run = await run_load(LoadConfig(url=f"http://127.0.0.1:{fake_openai.port}"), specs)
    assert all(r.ok for r in run.results)
    first, second = sorted(run.results, key=lambda r: r.start_s)
    assert second.start_s - first.start_s >= 0.09  # 200 ms / speedup 2
    bodies = sorted(fake_openai.bodies, key=lambda b: len(b["prompt"]))
    assert [len(b["prompt"]) for b in bodies] == [6, 8]
    assert bodies[0]["prompt"][:4] == bodies[1]["prompt"][:4]  # shared hash id 1
    assert [b["max_tokens"] for b in bodies] == [3, 2] and all(b["ignore_eos"] for b in bodies)


async def test_bodies_are_encoded_before_the_run_and_past_the_cap_on_the_fly(
    fake_openai, monkeypatch
):
    """Each request carries its own spec's body, whether encoded ahead or (past
    BODY_CACHE_BYTES, and when the workload cycles) when it is sent; the encoding ahead is
    not the run's client CPU."""
    from tandem.bench import loadgen

    url = f"http://127.0.0.1:{fake_openai.port}"
    fake_openai.first_token_delay_s = fake_openai.token_gap_s = 0.0
    specs = [RequestSpec(token_ids=[100 + i] * (i + 1), max_tokens=2) for i in range(6)]
    encoded: list[int] = []
    real = loadgen.encode_body

    seen_at_encode: list[int] = []  # requests the server had received at each encode

    def counting(spec, endpoint, model):
        encoded.append(len(spec.token_ids))
        seen_at_encode.append(len(fake_openai.bodies))
        return real(spec, endpoint, model)

    monkeypatch.setattr(loadgen, "encode_body", counting)
    monkeypatch.setattr(loadgen, "BODY_CACHE_BYTES", 1)  # the first body fills the cache
    run = await run_load(LoadConfig(url=url, concurrency=1, num_requests=8), specs)
    assert all(r.ok for r in run.results)
    # one ahead; specs 1..5 when sent, then the cycle: spec 0 cached, spec 1 again
    assert encoded == [1, 2, 3, 4, 5, 6, 2]
    assert [b["prompt"] for b in fake_openai.bodies[-8:]] == [s.token_ids for s in specs] + [
        specs[0].token_ids,
        specs[1].token_ids,
    ]
    assert seen_at_encode[1:6] == [n + 1 for n in range(seen_at_encode[0], seen_at_encode[0] + 5)]
    encoded.clear()
    seen_at_encode.clear()
    before = len(fake_openai.bodies)
    monkeypatch.setattr(loadgen, "BODY_CACHE_BYTES", 1 << 20)
    await run_load(LoadConfig(url=url, concurrency=2, num_requests=6), specs)
    assert encoded == [1, 2, 3, 4, 5, 6]
    assert seen_at_encode == [before] * 6  # all before the first request went out
