"""`tandem serve --frontend-processes`: the auto rule, validation, and the replicas' command."""

from __future__ import annotations

import pytest

from tandem.cli import serve


def _args(*flags: str):  # type: ignore[no-untyped-def]
    argv = ["--engine", "mocker", *flags]
    args, _ = serve.build_parser().parse_known_args(argv)
    args.argv = argv
    serve._validate(args)
    return args


def test_auto_is_one_process_per_four_cores() -> None:
    got = [serve.frontend_processes_for(n) for n in (1, 2, 4, 8, 16, 64)]
    assert got == [1, 1, 1, 2, 4, 8]


@pytest.mark.parametrize("value", ["0", "-2", "x"])
def test_bad_counts_are_refused_naming_the_value(value: str) -> None:
    with pytest.raises(SystemExit, match=f"--frontend-processes={value}; expected"):
        _args("--frontend-processes", value)


def test_several_processes_share_the_port_and_sync_routers() -> None:
    args = _args("--frontend-processes", "3", "--router", "kv", "--speedup-ratio", "0")
    assert args.http_reuse_port and args.router_replica_sync
    specs = serve.replica_specs(args, "/tmp/run", 8123)
    assert [s.name for s in specs] == ["frontend1", "frontend2"]
    argv = specs[0].argv
    assert argv[0] == "serve" and "--frontend-replica" in argv
    assert argv[argv.index("--port") + 1] == "8123" and "--speedup-ratio" in argv
    assert specs[0].command == "serve"


def test_one_process_keeps_the_plain_listener() -> None:
    args = _args("--frontend-processes", "1")
    assert not args.http_reuse_port and args.frontend_processes == 1
