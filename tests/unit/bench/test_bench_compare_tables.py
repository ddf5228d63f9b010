from __future__ import annotations

from tandem.bench.compare import frontend as frontend_compare


def _cell(system, conc, conn, req_per_s, cpu, isl=64):
    return {
        "system": system,
        "endpoint": "chat",
        "isl": isl,
        "cached_fraction": 0.5,
        "concurrency": conc,
        "connections": conn,
        "cpu_scope": "frontend",
        "req_per_s": req_per_s,
        "cpu_ms_per_req": cpu,
        "ttft_p50_ms": 1.0,
        "ttft_p99_ms": 2.0,
        "e2e_p50_ms": 3.0,
        "e2e_p99_ms": 4.0,
    }


def test_frontend_table_pairs_systems_and_gives_ratios():
    cells = [
        _cell("tandem", 8, "fresh", 600.0, 0.5),
        _cell("dynamo", 8, "fresh", 300.0, 1.0),
        _cell("tandem", 1, "reused", 100.0, 2.0),
    ]
    table = frontend_compare.format_table(cells)
    lines = table.splitlines()
    assert lines[2].split()[:4] == ["chat", "64", "1", "reused"] and "-" in lines[2]  # no dynamo
    assert "600.00 /    300.00 (2.00x)" in lines[3]
    assert "0.50 /      1.00 (0.50x)" in lines[3]


def test_frontend_table_has_a_row_per_isl_and_the_hit_rate():
    cells = [_cell(s, 16, "reused", 10.0, 1.0, isl) for s in ("tandem", "dynamo")
             for isl in (64, 6000, 32000)]  # fmt: skip
    lines = frontend_compare.format_table(cells).splitlines()
    assert [line.split()[1] for line in lines[2:5]] == ["64", "6000", "32000"]
    assert "cached_fraction" in lines[0] and "0.50 /      0.50 (1.00x)" in lines[2]


def test_frontend_table_shows_the_engines_and_the_clients_cpu():
    tandem = {**_cell("tandem", 64, "reused", 2000.0, 0.4), "engine_cpu_ms_per_req": 0.2,
              "client_cpu_ms_per_req": 0.15}  # fmt: skip
    dynamo = {**_cell("dynamo", 64, "reused", 1000.0, 0.8), "engine_cpu_ms_per_req": 0.1,
              "client_cpu_ms_per_req": 0.15}  # fmt: skip
    lines = frontend_compare.format_table([tandem, dynamo]).splitlines()
    assert "engine_cpu_ms_per_req" in lines[0] and "client_cpu_ms_per_req" in lines[0]
    assert "0.20 /      0.10 (2.00x)" in lines[2] and "0.15 /      0.15 (1.00x)" in lines[2]


def test_every_cell_gets_fresh_prompts_and_both_systems_the_same(monkeypatch, tmp_path):
    import argparse
    import contextlib
    import os

    from tandem.bench.tandem_stack import RunningStack

    sent: dict[str, list[tuple[int, ...]]] = {"tandem": [], "dynamo": []}
    current: list[str] = []

    @contextlib.contextmanager
    def stack(system, args, work_dir):
        current[:] = [system]
        yield RunningStack(  # this process stands in for the engine: its CPU is measured
            url="http://127.0.0.1:1",
            model="m",
            frontend_pid=1,
            cpu_scope="frontend",
            engine_pids=(os.getpid(),),
        )

    def run_cell(config, workload):
        sent[current[0]].append(tuple(workload[0].token_ids[:8]))
        summary = {"num_ok": 1, "num_errors": 0, "errors_by_status": {}, "req_per_s": 1.0,
                   "output_tok_per_s": 1.0, "ttft_ms": {"p50": 1, "p99": 1},
                   "e2e_ms": {"p50": 1, "p99": 1}, "itl_ms": {"p50": 1}}  # fmt: skip
        return summary

    monkeypatch.setattr(frontend_compare, "_stack", stack)
    monkeypatch.setattr(frontend_compare, "run_cell", run_cell)
    monkeypatch.setattr(frontend_compare, "cell_metrics", lambda summary, pid: {})
    parser = argparse.ArgumentParser()
    frontend_compare.add_arguments(parser)
    args = parser.parse_args(["--isl", "64,128", "--concurrency", "1,16", "--connections",
                              "reused", "--endpoint", "chat,completions"])  # fmt: skip
    for system in sent:
        cells = frontend_compare.measure_system(system, args, tmp_path)
        assert all(c["engine_cpu_ms_per_req"] >= 0 for c in cells)
    assert sent["tandem"] == sent["dynamo"]
    assert len(sent["tandem"]) == 4 * 3 and len(set(sent["tandem"])) == 12  # warmups too
    sent = {"tandem": []}
    frontend_compare.measure_system("tandem", parser.parse_args(["--reuse-prompts"]), tmp_path)
    assert len(sent["tandem"]) == 1 + 6 and len(set(sent["tandem"])) == 1
