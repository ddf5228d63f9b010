"""Instance records kept in discovery (DESIGN.md §1)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class ModelFile(msgspec.Struct, kw_only=True, frozen=True):
    """One model file that travels with a worker's registration: the sha256 (hex) of its
    bytes, by which the cluster's blob store (`tandem.runtime.blobs`) keeps it, and its size."""

    sha256: str
    size: int


# the tool-call formats and reasoning styles a frontend parses (tandem.frontend.pipeline.parsers)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")
REASONING_PARSERS = ("deepseek_r1", "qwen3")


class ModelCard(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a worker serves and how its KV cache is shaped; the frontend and router read it."""

    name: str
    context_length: int
    block_size: int
    num_total_blocks: int
    # where the worker loaded its tokenizer: "gguf:<path>" or "hf:<dir>" (a path on the
    # worker's host); None = no tokenizer
    tokenizer: str | None = None
    # the tokenizer as files in the cluster's blob store, by name (`tandem.tokens.model_files`:
    # tokenizer.json, tokenizer_meta.json): what a frontend on another
    # host loads. Empty from a worker older than these fields (the frontend then needs the
    # `tokenizer` path on its own host)
    files: dict[str, ModelFile] = msgspec.field(default_factory=dict)
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    engine: str = "mocker"
    # images (DESIGN.md §10): embedding rows per image, 0 = text only; the placeholder token the
    # prompt carries at each of those rows (its own embedding is never used)
    mm_num_tokens_per_image: int = 0
    mm_placeholder_token_id: int | None = None
    # what the worker serves: "generate" (its `generate` endpoint) and/or "embed" (its `embed`
    # endpoint, tandem.protocols.embedding); an embedding-only worker lists only "embed"
    tasks: list[str] = msgspec.field(default_factory=lambda: ["generate"])
    # embeddings: vector width (0 = none), and whether a prefix of a vector, renormalised, is
    # itself a valid embedding (Matryoshka-trained), which `dimensions` needs
    embedding_dim: int = 0
    embedding_matryoshka: bool = False
    # how the frontend reads the model's tool calls and reasoning (one of TOOL_CALL_PARSERS /
    # REASONING_PARSERS; None: decided from the chat template, else Hermes / no reasoning)
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


class Instance(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One registered endpoint of one process. `instance_id` is unique and dies with its lease."""

    version: int = 1
    instance_id: str
    namespace: str
    component: str
    endpoint: str
    address: str  # host:port of the process's request-plane server
    model: ModelCard | None = None
    # extra runtime config (data-parallel size, disagg role, transfer backends, ...)
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def path(self) -> str:
        return f"{self.namespace}.{self.component}.{self.endpoint}"


class InstanceEvent(msgspec.Struct, kw_only=True):
    kind: Literal["added", "removed"]
    instance: Instance


def endpoint_path(namespace: str, component: str, endpoint: str) -> str:
    return f"{namespace}.{component}.{endpoint}"
