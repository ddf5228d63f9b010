"""`--lora` and `--lora-dir`: what parses, and the clear error for what does not."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tandem.frontend.args import add_frontend_args, frontend_config_from_args
from tandem.frontend.lora_config import LoraApiConfig, LoraSpec, parse_lora_spec
from tandem.runtime.flag_parser import parse_args


def test_name_equals_path_and_vllm_json() -> None:
    assert parse_lora_spec("sql=/a/sql") == LoraSpec(name="sql", path="/a/sql")
    spec = parse_lora_spec('{"name": "sql", "path": "/a/sql", "base_model_name": "smollm2"}')
    assert spec == LoraSpec(name="sql", path="/a/sql", base_model="smollm2")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("sql", "expected NAME=PATH"),
        ("sql=", "empty path"),
        ("=/a", "adapter name"),
        ("a b=/a", "printable ASCII"),
        ('{"name": "sql"}', "JSON object with name, path"),
        ("{not json", "JSON object with name, path"),
    ],
)
def test_bad_specs_are_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_lora_spec(text)


def test_lora_dir_must_be_a_directory(tmp_path: Path) -> None:
    assert LoraApiConfig(lora_dir=str(tmp_path)).resolved_dir == str(tmp_path.resolve())
    with pytest.raises(ValueError, match="is not a directory"):
        LoraApiConfig(lora_dir=str(tmp_path / "missing"))
    twice = (LoraSpec(name="a", path="/x"), LoraSpec(name="a", path="/y"))
    with pytest.raises(ValueError, match="names an adapter twice"):
        LoraApiConfig(adapters=twice)


def test_flags_reach_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_frontend_args(parser)
    monkeypatch.setenv("TANDEM_LORA_DIR", str(tmp_path))
    config = frontend_config_from_args(parse_args(parser, ["--lora", "a=/x", "--lora", "b=/y"]))
    assert [s.name for s in config.lora.adapters] == ["a", "b"]
    assert config.lora.resolved_dir == str(tmp_path.resolve())
    monkeypatch.setenv("TANDEM_LORA", "c=/x,d=/y")  # env: comma-separated
    assert [s.name for s in frontend_config_from_args(parse_args(parser, [])).lora.adapters] == [
        "c",
        "d",
    ]
    with pytest.raises(SystemExit, match="expected NAME=PATH"):
        frontend_config_from_args(parse_args(parser, ["--lora", "nonsense"]))
