"""Build a HF `tokenizers.Tokenizer` from a GGUF file's tokenizer metadata.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, merges, token types and
special ids as metadata (`tokenizer.ggml.*`). Only byte-level BPE (`tokenizer.ggml.model ==
"gpt2"`, used by SmolLM2, Llama 3, Qwen 2) is supported here. Reading a GGUF parses every
tensor header (seconds), so the converted tokenizer.json and metadata are cached on disk,
keyed by the file's absolute path, size and mtime.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from tandem.tokens.byte_level import BYTE_TO_CHAR

logger = logging.getLogger(__name__)

# bump when the conversion changes so stale cache entries are ignored
CONVERTER_VERSION = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# llama.cpp pre-tokenizer names whose split regex differs from GPT-2's
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT}


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "tandem" / "tokenizers"


def load_gguf_tokenizer(
    path: str | os.PathLike[str], *, cache_dir: Path | None = None
) -> tuple[Tokenizer, dict[str, Any]]:
    """Return (tokenizer, metadata) for the GGUF at `path`, converting once and caching.

    metadata keys: bos_token_id, eos_token_id, chat_template, context_length, add_bos_token.
    Raises FileNotFoundError if the file is missing, ValueError for unsupported tokenizers.
    """
    file = Path(path).resolve()
    stat = file.stat()
    key_src = f"{file}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERTER_VERSION}"
    entry = (cache_dir or default_cache_dir()) / hashlib.sha256(key_src.encode()).hexdigest()[:24]
    tok_file, meta_file = entry / "tokenizer.json", entry / "meta.json"
    if tok_file.exists() and meta_file.exists():
        return Tokenizer.from_file(str(tok_file)), json.loads(meta_file.read_text())
    logger.info("converting GGUF tokenizer path=%s (cached after)", file)
    tokenizer, meta = convert_gguf(file)
    entry.mkdir(parents=True, exist_ok=True)
    _atomic_write(tok_file, tokenizer.to_str())
    _atomic_write(meta_file, json.dumps(meta))
    return tokenizer, meta


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def read_gguf_fields(path: Path) -> dict[str, Any]:
    """The `general.*`, `*.context_length` and `tokenizer.*` metadata of a GGUF as Python values."""
    from gguf import GGUFReader  # slow import; only needed on a cache miss

    reader = GGUFReader(str(path))
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith(("tokenizer.", "general.architecture")) or name.endswith(
            ".context_length"
        ):
            out[name] = field.contents()
    return out


def convert_gguf(path: Path) -> tuple[Tokenizer, dict[str, Any]]:
    fields = read_gguf_fields(path)
    model_type = fields.get("tokenizer.ggml.model")
    if model_type != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer.ggml.model {model_type!r} in {path}; expected one of: gpt2"
        )
    arch = fields.get("general.architecture", "llama")
    tokenizer = build_byte_level_bpe(
        tokens=list(fields["tokenizer.ggml.tokens"]),
        merges=list(fields.get("tokenizer.ggml.merges", [])),
        token_types=list(fields.get("tokenizer.ggml.token_type", [])),
        pre=fields.get("tokenizer.ggml.pre"),
    )
    meta = {
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
        "chat_template": fields.get("tokenizer.chat_template"),
        "context_length": fields.get(f"{arch}.context_length"),
        "add_bos_token": bool(fields.get("tokenizer.ggml.add_bos_token", False)),
    }
    return tokenizer, meta


def build_byte_level_bpe(
    *, tokens: list[str], merges: list[str], token_types: list[int], pre: str | None
) -> Tokenizer:
    """Byte-level BPE over `tokens` (GGUF order = ids). Control tokens become special added
    tokens and user-defined ones plain added tokens, so both match whole in text."""
    alphabet = set(BYTE_TO_CHAR.values())
    vocab = {
        tok if set(tok) <= alphabet else "".join(BYTE_TO_CHAR[b] for b in tok.encode()): i
        for i, tok in enumerate(tokens)
    }
    pairs = [(a, b) for a, _, b in (m.partition(" ") for m in merges)]
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    tokenizer = Tokenizer(bpe)
    split = _PRE_SPLITS.get(pre or "")
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    special, plain = [], []
    for tok, ttype in zip(tokens, token_types, strict=False):
        if ttype == TOKEN_TYPE_CONTROL and set(tok) <= alphabet:
            special.append(AddedToken(tok, normalized=False, special=True))
        elif ttype == TOKEN_TYPE_USER_DEFINED:
            plain.append(AddedToken(tok, normalized=False, special=False))
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)
    return tokenizer
