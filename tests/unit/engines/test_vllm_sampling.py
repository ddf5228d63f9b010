"""Pure parts of the vLLM adapter's request mapping (vLLM itself is not in this venv; the
mapping on the real engine is tests/e2e/test_vllm_serve.py): json_schema strictness made
explicit, constraints without a spec refused, and the cores `tandem serve` shares out."""

from __future__ import annotations

import argparse
import json

import pytest

from tandem.cli.serve import build_parser, worker_specs
from tandem.engines.vllm.config import VllmWorkerConfig, cpu_shares
from tandem.engines.vllm.sampling import _schema, structured_outputs
from tandem.errors import InvalidRequest
from tandem.protocols.engine import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "pets": {"type": "array", "items": {"type": "object", "properties": {"x": {}}}},
        "meta": {"type": "object", "additionalProperties": True},
    },
}


@pytest.mark.parametrize("strict", [True, False])
def test_json_schema_objects_get_explicit_additional_properties(strict: bool) -> None:
    out = _schema(json.dumps(SCHEMA), strict=strict)
    assert out["additionalProperties"] is not strict
    assert out["properties"]["pets"]["items"]["additionalProperties"] is not strict
    assert out["properties"]["meta"]["additionalProperties"] is True  # the schema's own word
    assert "additionalProperties" not in out["properties"]["name"]


@pytest.mark.parametrize(
    ("spec", "match"), [("{not json", "not valid JSON"), ("[1, 2]", "must be a JSON object")]
)
def test_bad_json_schema_is_an_invalid_request(spec: str, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        _schema(spec, strict=True)


@pytest.mark.parametrize("kind", ["json_schema", "regex", "grammar"])
def test_constraint_without_spec_is_an_invalid_request(kind: str) -> None:
    with pytest.raises(InvalidRequest, match=f"kind '{kind}' without a spec"):
        structured_outputs(StructuredOutput(kind=kind))  # type: ignore[arg-type]


def test_cpu_shares_are_disjoint_and_cover_the_cores() -> None:
    assert cpu_shares(2, [0, 1]) == ["0", "1"]
    assert cpu_shares(2, [0, 1, 2, 3, 4]) == ["0,1,2", "3,4"]
    assert cpu_shares(3, [4, 5]) == ["4", "5", "4"]  # more workers than cores: round robin
    assert cpu_shares(0, [0, 1]) == []


def test_vllm_cpus_must_be_core_ids() -> None:
    assert VllmWorkerConfig(cpus="0,2-3").cpus == "0,2-3"
    with pytest.raises(ValueError, match="expected core ids"):
        VllmWorkerConfig(cpus="all")


def _serve_args(*argv: str) -> argparse.Namespace:
    args, _ = build_parser().parse_known_args(["--engine", "vllm", *argv])
    return args


def test_serve_gives_each_vllm_worker_its_own_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("TANDEM_VLLM_CPUS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    specs = worker_specs(_serve_args("--prefill-workers", "1", "--decode-workers", "1"), [])
    cpus = [s.argv[s.argv.index("--vllm-cpus") + 1] for s in specs]
    assert cpus == ["0,1", "2,3"]
    assert all("--vllm-cpus" not in s.argv for s in worker_specs(_serve_args(), []))  # one
    chosen = worker_specs(_serve_args("--workers", "2"), ["--vllm-cpus", "0"])
    assert all(s.argv.count("--vllm-cpus") == 1 for s in chosen)  # the user's, unchanged
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert all("--vllm-cpus" not in s.argv for s in worker_specs(_serve_args("--workers", "2"), []))
    mocker = worker_specs(_serve_args("--workers", "2", "--engine", "mocker"), [])
    assert all("--vllm-cpus" not in s.argv for s in mocker)
