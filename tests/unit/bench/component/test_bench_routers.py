"""`tandem bench routers` (issue 31): its oracle, text prompts, workloads, flags and table;
`tandem bench churn` on a tiny run."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tandem.bench.compare.http_routers import HTTP_ROUTERS
from tandem.bench.component import churn, routers
from tandem.bench.component.router_workloads import (
    AgentSessionsConfig,
    TextPrompts,
    agent_sessions,
    oracle_cached_fraction,
)


def test_oracle_counts_leading_blocks_seen_before_over_all_tokens() -> None:
    a = list(range(8))  # 4 blocks of 2
    b = [*a[:4], 90, 91, 92]  # shares 2 blocks, then differs; a partial last block
    c = [5, 6, *a[2:]]  # shares nothing: block 0 differs, so later equal tokens do not count
    assert oracle_cached_fraction([a], 2) == 0.0
    assert oracle_cached_fraction([a, b], 2) == pytest.approx(4 / 15)
    assert oracle_cached_fraction([a, b, c, a], 2) == pytest.approx((4 + 8) / (8 + 7 + 8 + 8))
    assert oracle_cached_fraction([], 2) is None


def test_text_prompts_keep_length_and_shared_prefixes() -> None:
    vocab = ["<s>", "Ġthe", "Ġx", "ĠAB"] + [f"Ġw{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}q"
                                          for i in range(1200)]  # fmt: skip
    text = TextPrompts(vocab)
    assert " x" not in text.words and " AB" not in text.words and " the" in text.words
    one, two = text.text([5, 6, 7]), text.text([5, 6, 8])
    assert one.count(" ") == 3 and one.startswith(" ")
    assert one[: one.rindex(" ")] == two[: two.rindex(" ")]
    assert text.word_ids([len(text.words) + 2]) == [2]
    with pytest.raises(ValueError, match="one-token words"):
        TextPrompts(["Ġthe"])


def test_agent_sessions_grow_each_turn_over_a_shared_system_prompt() -> None:
    cfg = AgentSessionsConfig(num_sessions=6, turns=3, num_system_prompts=2, system_len=32,
                              user_len=8, answer_len=4, session_rate_per_s=10.0,
                              think_s=1.0)  # fmt: skip
    specs = agent_sessions(cfg)
    assert len(specs) == 18
    times = [s.send_at_s or 0.0 for s in specs]
    assert times == sorted(times)
    lengths = sorted({len(s.token_ids) for s in specs})
    assert lengths == [40, 52, 64]  # system + (user + answer) per earlier turn + user
    systems = {tuple(s.token_ids[:32]) for s in specs}
    assert len(systems) <= 2
    oracle = oracle_cached_fraction((s.token_ids for s in specs), 4)
    assert oracle is not None and oracle > 0.5


def test_systems_workers_and_prompts_parse_or_fail_clearly() -> None:
    systems = routers.parse_systems("kv, tandem:round_robin,kv+fetch,dynamo:kv,smg:cache_aware")
    names = ["kv", "round_robin", "kv+fetch", "dynamo:kv", "smg:cache_aware"]
    assert [s.name for s in systems] == names
    assert [s.fetch for s in systems] == [False, False, True, False, False]
    for wrong in ("round_robin+fetch", "dynamo:kv+fetch", "kv+cache"):
        with pytest.raises(ValueError, match=r"only tandem's kv router takes '\+fetch'"):
            routers.parse_systems(wrong)
    assert routers.parse_workers("4,8") == [4, 8]
    assert routers.parse_prompts("text") == ["text"]
    with pytest.raises(ValueError, match="unknown system"):
        routers.parse_systems("sglang:cache_aware")
    with pytest.raises(ValueError, match="no policy"):
        routers.parse_systems("smg:")
    with pytest.raises(ValueError, match="workers"):
        routers.parse_workers("0")
    with pytest.raises(ValueError, match="prompt variant"):
        routers.parse_prompts("ids")
    assert routers.parse_ratios("1,1,0.5,0.25") == [1.0, 1.0, 0.5, 0.25]
    with pytest.raises(ValueError, match="speedup_ratios"):
        routers.parse_ratios("1,0")


def test_a_peer_not_set_up_is_a_row_that_says_how(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    kind = HTTP_ROUTERS["smg"]
    monkeypatch.setitem(
        HTTP_ROUTERS,
        "smg",
        type(kind)(kind.name, kind.anchor_dir, str(tmp_path / "none"), kind.binary),
    )
    row = routers.measure_row(routers.System("smg", "cache_aware"), "text", 4, [], lambda n: 0.5,
                              argparse.Namespace(), tmp_path)  # fmt: skip
    assert row["error"].startswith("not set up (run bash ") and "smg/setup.sh" in row["error"]
    table = routers.format_table([row, _row()])
    assert "not set up" in table.splitlines()[2]
    assert "90.0%" in table.splitlines()[3] and "45.0%" in table.splitlines()[3]


def _row() -> dict[str, object]:
    return {"system": "kv", "prompts": "tokens", "workers": 4, "num_ok": 10, "num_errors": 0,
            "ttft_p50_ms": 100.0, "ttft_p90_ms": 200.0, "ttft_p99_ms": 300.0,
            "cached_fraction": 0.45, "oracle": 0.5, "share_of_oracle": 0.9,
            "router_cpu_ms_per_req": 1.5, "front_cpu_ms_per_req": 3.0}  # fmt: skip


def test_churn_keeps_the_index_equal_to_the_caches_and_passes() -> None:
    args = churn.parse_args(["--requests", "600", "--workers", "2", "--capacity-blocks", "64",
                             "--prompt-blocks", "8", "--families", "4", "--samples", "3",
                             "--max-growth-mb", "64"])  # fmt: skip
    result = churn.run(args)
    assert result["verdict"] == "PASS", result["problems"]
    assert result["indexed_blocks"] == result["worker_blocks"] == 128
    assert len(result["samples"]) == 3
    assert "verdict PASS" in churn.format_result(result)


def test_a_tandem_row_counts_the_fetches_its_router_hinted() -> None:
    import http.server
    import threading

    body = (
        b'tandem_router_kv_fetches_total{model="m",component="backend"} 3\n'
        b'tandem_router_kv_fetch_blocks_total{model="m",component="backend"} 720\n'
        b'tandem_router_kv_fetch_blocks_total{model="n",component="backend"} 5\n'
    )

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert routers.fetch_hints(f"http://127.0.0.1:{server.server_port}") == (3, 725)
    finally:
        server.shutdown()
        server.server_close()
    assert routers.fetch_hints("http://127.0.0.1:9") is None  # nothing listens: no figure


def test_the_oracle_is_over_the_requests_a_row_sent() -> None:
    """A row stopped by --duration-s after 2 of 4 requests is measured against the oracle
    of those 2 (the full trace reused far more: 1091 of the Mooncake trace's 3993 records
    sent, oracle 16.9 % over them against 64.9 % over all)."""
    from tandem.bench.workload import RequestSpec

    a, b = list(range(100, 108)), list(range(200, 208))
    specs = [RequestSpec(token_ids=p, max_tokens=1) for p in (a, b, a, a)]
    ((sent, oracle),) = routers.variant_specs(specs, ["tokens"], 2).values()
    assert sent == specs
    assert oracle(2) == 0.0
    assert oracle(4) == pytest.approx(oracle_cached_fraction([a, b, a, a], 2))
    assert oracle(4) > 0.4
