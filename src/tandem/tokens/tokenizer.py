"""Load a model's tokenizer from a spec string: "gguf:<path>" or "hf:<dir>".

A `ModelTokenizer` bundles the HF `tokenizers.Tokenizer` with what serving needs next to it:
eos/bos ids, the chat template, the context length, and (for byte-level BPE) a per-id byte
table the incremental detokenizer uses. Loaded once per spec per process.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from tandem.tokens.ascii_encoder import AsciiByteLevelEncoder, OverBudget
from tandem.tokens.byte_level import token_bytes
from tandem.tokens.gguf import load_gguf_tokenizer

SOURCES = ("gguf", "hf")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelTokenizer:
    """A loaded tokenizer; immutable and safe to share between requests and threads."""

    backend: Tokenizer
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    chat_template: str | None = None
    context_length: int | None = None
    add_bos_token: bool = False
    special_token_ids: frozenset[int] = frozenset()
    # raw bytes of every id for byte-level BPE (b"" for special ids); None otherwise
    id_bytes: tuple[bytes, ...] | None = field(default=None, repr=False)
    # id_bytes as text where an id's bytes are complete UTF-8 on their own, else None (the
    # detokenizer's per-token shortcut); None when id_bytes is
    id_text: tuple[str | None, ...] | None = field(default=None, repr=False)
    # exact and ~10x cheaper for ASCII text on GPT-2-style byte-level BPE; None otherwise
    ascii_encoder: AsciiByteLevelEncoder | None = field(default=None, repr=False)
    vocab_size: int = field(init=False, default=0)  # with added tokens; read per request

    def __post_init__(self) -> None:
        size = int(self.backend.get_vocab_size(with_added_tokens=True))
        object.__setattr__(self, "vocab_size", size)

    def token_text(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(
        self, text: str, *, add_special_tokens: bool = True, miss_budget: int | None = None
    ) -> list[int]:
        """Token ids of `text`. Special tokens written in the text match whole; with
        `add_special_tokens` the BOS is prepended where the model asks for one. With
        `miss_budget`: OverBudget rather than run BPE on more words than that (ASCII text
        through the word cache), or at all (other text: its pre-tokenizer's cost grows with
        the text)."""
        ids: list[int]
        if self.ascii_encoder is not None and text.isascii():
            ids = self.ascii_encoder.encode(text, miss_budget=miss_budget)
        elif miss_budget is not None:
            raise OverBudget("not ASCII: no word cache")
        else:
            ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if (
            add_special_tokens
            and self.add_bos_token
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids.insert(0, self.bos_token_id)
        return ids

    def prewarm(self) -> int:
        """Fill the word cache with the vocabulary's one-token words (0 without the cache)."""
        return self.ascii_encoder.prewarm() if self.ascii_encoder is not None else 0

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens))


_cache: dict[str, ModelTokenizer] = {}
_lock = threading.Lock()


def load_tokenizer(spec: str, *, cache_dir: Path | None = None) -> ModelTokenizer:
    """Load (once per process) the tokenizer named by `spec`. Raises ValueError for an
    unknown source and FileNotFoundError when the file or directory is missing."""
    with _lock:
        if spec in _cache:
            return _cache[spec]
    source, sep, location = spec.partition(":")
    if not sep or source not in SOURCES:
        raise ValueError(
            f"unknown tokenizer source '{source if sep else spec}'; "
            f"expected one of: {', '.join(SOURCES)} (as 'gguf:<path>' or 'hf:<dir>')"
        )
    if source == "gguf":
        backend, meta = load_gguf_tokenizer(location, cache_dir=cache_dir)
    else:
        backend, meta = _load_hf_dir(Path(location))
    tok = bundle_tokenizer(backend, meta)
    with _lock:
        return _cache.setdefault(spec, tok)


def bundle_tokenizer(backend: Tokenizer, meta: dict[str, Any]) -> ModelTokenizer:
    """A `ModelTokenizer` from a `tokenizers` backend and its meta (eos/bos ids, chat
    template, context length, add_bos_token)."""
    special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    eos = meta.get("eos_token_id")
    eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
    id_bytes = _byte_table(backend, special_ids)
    return ModelTokenizer(
        backend=backend,
        eos_token_ids=tuple(int(i) for i in eos_ids),
        bos_token_id=meta.get("bos_token_id"),
        chat_template=meta.get("chat_template"),
        context_length=meta.get("context_length"),
        add_bos_token=bool(meta.get("add_bos_token", False)),
        special_token_ids=special_ids,
        id_bytes=id_bytes,
        id_text=text_table(id_bytes) if id_bytes is not None else None,
        ascii_encoder=AsciiByteLevelEncoder.build(backend),
    )


def _byte_table(backend: Tokenizer, special_ids: frozenset[int]) -> tuple[bytes, ...] | None:
    """Per-id raw bytes when the tokenizer is byte-level BPE, else None."""
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        return None
    size = backend.get_vocab_size(with_added_tokens=True)
    table: list[bytes] = []
    for i in range(size):
        spelled = backend.id_to_token(i)
        if i in special_ids or spelled is None:
            table.append(b"")
            continue
        raw = token_bytes(spelled)
        # an added (non-special) token spelled outside the alphabet decodes as its text
        table.append(raw if raw is not None else spelled.encode())
    return tuple(table)


def text_table(id_bytes: tuple[bytes, ...]) -> tuple[str | None, ...]:
    """Each id's bytes decoded, where they are complete UTF-8 on their own; None where a
    token holds part of a character (it must go through an incremental decoder)."""
    table: list[str | None] = []
    for raw in id_bytes:
        try:
            table.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            table.append(None)
    return tuple(table)


def _load_hf_dir(directory: Path) -> tuple[Tokenizer, dict[str, Any]]:
    backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    cfg = _read_json(directory / "tokenizer_config.json")
    model_cfg = _read_json(directory / "config.json")
    gen_cfg = _read_json(directory / "generation_config.json")
    template = cfg.get("chat_template")
    jinja_file = directory / "chat_template.jinja"
    if template is None and jinja_file.exists():
        template = jinja_file.read_text()
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    eos = gen_cfg.get("eos_token_id", model_cfg.get("eos_token_id"))
    if eos is None and (eos_text := _token_content(cfg.get("eos_token"))) is not None:
        eos = backend.token_to_id(eos_text)
    bos_text = _token_content(cfg.get("bos_token"))
    return backend, {
        "eos_token_id": eos,
        "bos_token_id": backend.token_to_id(bos_text) if bos_text else None,
        "chat_template": template,
        "context_length": model_cfg.get("max_position_embeddings"),
        # the tokenizer.json post-processor already adds BOS where the model wants it
        "add_bos_token": False,
    }


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}
