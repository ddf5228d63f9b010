"""A model's tokenizer as files that travel with a worker's registration.

A worker turns the tokenizer it loaded (from a GGUF or a Hugging Face folder on its own host)
into two files — `tokenizer.json` (the `tokenizers` library's own serialization) and
`tokenizer_meta.json` (special token ids, the chat template, the context length) — and puts
them in the cluster's blob store (`tandem.runtime.blobs`), naming them by sha256 in its model
card; a frontend on a host without the model's files rebuilds the same tokenizer from them.
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import Tokenizer

from tandem.tokens.tokenizer import ModelTokenizer, bundle_tokenizer

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_META = "tokenizer_meta.json"
FILE_NAMES = (TOKENIZER_JSON, TOKENIZER_META)


def tokenizer_files(tok: ModelTokenizer) -> dict[str, bytes]:
    """The files that rebuild `tok` (`tokenizer_from_files`), by name."""
    meta: dict[str, Any] = {
        "eos_token_id": list(tok.eos_token_ids),
        "bos_token_id": tok.bos_token_id,
        "chat_template": tok.chat_template,
        "context_length": tok.context_length,
        "add_bos_token": tok.add_bos_token,
    }
    return {
        TOKENIZER_JSON: tok.backend.to_str().encode(),
        TOKENIZER_META: json.dumps(meta, sort_keys=True).encode(),
    }


def tokenizer_from_files(files: dict[str, bytes]) -> ModelTokenizer:
    """The tokenizer `files` describe. Raises ValueError naming the file that is missing or
    does not parse."""
    for name in FILE_NAMES:
        if name not in files:
            raise ValueError(f"model file {name} is missing (have: {', '.join(files) or 'none'})")
    try:
        backend = Tokenizer.from_str(files[TOKENIZER_JSON].decode())
    except Exception as exc:  # the tokenizers library raises its own exception types
        raise ValueError(f"model file {TOKENIZER_JSON} does not parse: {exc}") from exc
    try:
        meta = json.loads(files[TOKENIZER_META])
    except ValueError as exc:
        raise ValueError(f"model file {TOKENIZER_META} does not parse: {exc}") from exc
    if not isinstance(meta, dict):
        raise ValueError(f"model file {TOKENIZER_META} is not a JSON object")
    return bundle_tokenizer(backend, meta)
