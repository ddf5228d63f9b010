"""Mooncake trace replay: JSONL records → `RequestSpec`s with exact token-id prompts.

Record format (one JSON object a line): `timestamp` (ms from trace start), `input_length`,
`output_length`, `hash_ids` (one id per `block_size`-token block of the prompt). Two requests
sharing hash id h share the same token block at that position, so they share KV prefix.

Prompt construction contract: block h is `block_size` pseudo-random token ids drawn from a
generator seeded by (seed, h); the prompt is the concatenation of its blocks trimmed to
`input_length` (padded with tokens unique to the request when the blocks are too few), then
clipped to `max_input_length` when one is set. Sends at `timestamp / 1000 / speedup` s.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from tandem.bench.workload import DEFAULT_VOCAB_SIZE, FIRST_PLAIN_TOKEN_ID, RequestSpec
from tandem.config_check import check_range

# Pad blocks get ids far from any trace's hash ids so they never collide with a real block.
_PAD_SEED_BASE = 1 << 40


class TraceRecord(msgspec.Struct, frozen=True):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int] = []


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceConfig:
    block_size: int = 512
    vocab_size: int = DEFAULT_VOCAB_SIZE
    speedup: float = 1.0
    max_requests: int | None = None
    max_input_length: int | None = None
    min_output_length: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        check_range("block_size", self.block_size, low=1)
        check_range("vocab_size", self.vocab_size, low=FIRST_PLAIN_TOKEN_ID, low_open=True)
        check_range("speedup", self.speedup, low=0, low_open=True)
        if self.max_requests is not None:
            check_range("max_requests", self.max_requests, low=1)
        if self.max_input_length is not None:
            check_range("max_input_length", self.max_input_length, low=1)


class BlockTokens:
    """Maps a hash id to its fixed token block; cached, so shared blocks are built once."""

    def __init__(self, block_size: int, vocab_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.seed = seed
        self._cache: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        tokens = self._cache.get(hash_id)
        if tokens is None:
            rng = np.random.default_rng([self.seed, hash_id])
            tokens = rng.integers(
                FIRST_PLAIN_TOKEN_ID, self.vocab_size, size=self.block_size, dtype=np.int64
            ).tolist()
            self._cache[hash_id] = tokens
        return tokens

    def prompt(self, hash_ids: list[int], input_length: int, pad_key: int) -> list[int]:
        """Concatenated blocks trimmed to `input_length`; pads with blocks unique to `pad_key`."""
        tokens: list[int] = []
        for hash_id in hash_ids:
            if len(tokens) >= input_length:
                break
            tokens.extend(self.block(hash_id))
        pad = 0
        while len(tokens) < input_length:
            rng = np.random.default_rng([self.seed, _PAD_SEED_BASE + pad_key, pad])
            tokens.extend(
                rng.integers(FIRST_PLAIN_TOKEN_ID, self.vocab_size, size=self.block_size).tolist()
            )
            pad += 1
        return tokens[:input_length]


@dataclass(frozen=True, slots=True)
class TracePrompt:
    """A `PromptSource`: the prompt of one trace record, built when it is sent."""

    blocks: BlockTokens
    hash_ids: list[int]
    input_length: int
    pad_key: int

    def token_ids(self) -> list[int]:
        return self.blocks.prompt(self.hash_ids, self.input_length, self.pad_key)


def read_records(path: str | Path, max_requests: int | None = None) -> Iterator[TraceRecord]:
    decoder = msgspec.json.Decoder(TraceRecord)
    with open(path, "rb") as f:
        count = 0
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            if max_requests is not None and count >= max_requests:
                return
            try:
                yield decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise ValueError(f"{path}:{line_no}: bad trace record: {exc}") from exc
            count += 1


def trace_requests(path: str | Path, config: TraceConfig) -> list[RequestSpec]:
    """All (or the first `max_requests`) records of a trace as requests with send times; prompts
    are built when sent (a trace's prompts together can hold tens of millions of tokens)."""
    blocks = BlockTokens(config.block_size, config.vocab_size, config.seed)
    specs = []
    for index, record in enumerate(read_records(path, config.max_requests)):
        length = record.input_length
        if config.max_input_length is not None:
            length = min(length, config.max_input_length)
        specs.append(
            RequestSpec(
                source=TracePrompt(blocks, record.hash_ids, length, index),
                max_tokens=max(record.output_length, config.min_output_length),
                ignore_eos=True,
                send_at_s=record.timestamp / 1000.0 / config.speedup,
            )
        )
    return specs
