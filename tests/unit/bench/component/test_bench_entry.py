"""The one entry of the component benchmarks that compute one result."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from tandem.bench.component.entry import figures_main

pytestmark = pytest.mark.timeout(10)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    return {"squares": [i * i for i in range(args.n)]}


def _format(result: dict[str, Any]) -> str:
    return "squares " + " ".join(map(str, result["squares"]))


def test_prints_the_table_and_writes_json_only_when_asked(tmp_path, capsys) -> None:
    assert figures_main(["--n", "3"], _parse, _run, _format) == 0
    assert capsys.readouterr().out == "squares 0 1 4\n"
    path = tmp_path / "figures.json"
    assert figures_main(["--n", "3", "--json", str(path)], _parse, _run, _format) == 0
    assert json.loads(path.read_text()) == {"squares": [0, 1, 4]}
