"""The frontend's LoRA flags (issue 32): `--lora` adapters to serve from the start,
`--lora-dir` the one directory runtime loads may read from; parsed into `LoraApiConfig`."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field

from tandem.config_check import check_range

MAX_ADAPTER_NAME_CHARS = 256


def check_adapter_name(name: str) -> str:
    """`name` if it can name an adapter (a `model` value): 1-256 printable ASCII characters,
    no spaces; else ValueError saying so."""
    if not 0 < len(name) <= MAX_ADAPTER_NAME_CHARS or not all("!" <= c <= "~" for c in name):
        raise ValueError(
            f"LoRA adapter name {name[:64]!r} is invalid; expected 1 to "
            f"{MAX_ADAPTER_NAME_CHARS} printable ASCII characters without spaces"
        )
    return name


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraSpec:
    """One `--lora`: the adapter's name, its directory, and (with several models served) the
    base model it belongs to."""

    name: str
    path: str
    base_model: str | None = None

    def __post_init__(self) -> None:
        check_adapter_name(self.name)
        if not self.path:
            raise ValueError(f"--lora {self.name}: empty path; expected NAME=PATH")


def parse_lora_spec(text: str) -> LoraSpec:
    """`NAME=PATH`, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`."""
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
            return LoraSpec(
                name=str(spec["name"]), path=str(spec["path"]),
                base_model=spec.get("base_model_name"),
            )  # fmt: skip
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"--lora {text!r}: expected NAME=PATH or a JSON object with name, path and "
                f"optionally base_model_name ({exc})"
            ) from exc
    name, sep, path = text.partition("=")
    if not sep:
        raise ValueError(f"--lora {text!r}: expected NAME=PATH")
    return LoraSpec(name=name.strip(), path=path.strip())


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraApiConfig:
    """`adapters`: loaded once a worker of their base model can take them (from any
    directory: the operator named them). `lora_dir`: runtime loads (`POST
    /v1/load_lora_adapter`) read only under it, symlinks resolved; None: runtime loads are
    refused. `catalog_poll_s`: how often the adapter catalog is read again (adapters loaded
    or unloaded through another frontend show here within it)."""

    adapters: tuple[LoraSpec, ...] = ()
    lora_dir: str | None = None
    catalog_poll_s: float = 1.0
    load_timeout_s: float = 120.0
    resolved_dir: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        check_range("catalog_poll_s", self.catalog_poll_s, low=0.05, high=60)
        check_range("load_timeout_s", self.load_timeout_s, low=1, high=3600)
        names = [a.name for a in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora names an adapter twice: {sorted(names)}")
        if self.lora_dir is not None:
            if not os.path.isdir(self.lora_dir):
                raise ValueError(f"--lora-dir {self.lora_dir!r} is not a directory")
            object.__setattr__(self, "resolved_dir", os.path.realpath(self.lora_dir))


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA adapters")
    g.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve the PEFT adapter in directory PATH as model NAME (repeatable; also vLLM's "
        'JSON form {"name", "path", "base_model_name"}); loaded once a worker of its base '
        "model (the one model served, else base_model_name) is up; env: comma-separated "
        "NAME=PATH pairs",
    )
    g.add_argument(
        "--lora-dir",
        default=None,
        metavar="DIR",
        help="POST /v1/load_lora_adapter loads adapters only from directories under DIR "
        "(symlinks resolved; elsewhere 403); without it runtime loading is refused",
    )


def lora_config_from_args(ns: argparse.Namespace) -> LoraApiConfig:
    try:
        specs = tuple(parse_lora_spec(text) for text in ns.lora)
        return LoraApiConfig(adapters=specs, lora_dir=ns.lora_dir)
    except ValueError as exc:
        raise SystemExit(f"tandem: error: {exc}") from exc
