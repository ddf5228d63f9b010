from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.tokens import tokenizer as tokenizer_mod
from tandem.tokens.tokenizer import ModelTokenizer, load_tokenizer

SAMPLES = [
    "Hello, world!",
    "  leading and trailing spaces   ",
    "tabs\tand\nnewlines\r\n\n\nmore",
    "numbers 12345 and 3.14159, 1e-10",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}\n",
    "Unicode: héllo wörld — ñandú, 日本語のテキスト, 한국어, العربية, emoji 🎉👩‍👩‍👧",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "special in the middle<|endoftext|>after <file_sep>x",
    "I'm sure they've said 'you'll' and \"we'd\" DON'T",
    "\u00a0nbsp and zero\u200bwidth",
    "",
    "       ",
]


@pytest.mark.timeout(60)
def test_gguf_tokenizer_matches_transformers_conversion(gguf_path: Path) -> None:
    from transformers import AutoTokenizer

    ours = load_tokenizer(f"gguf:{gguf_path}")
    ref = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    for text in SAMPLES:
        expected = ref.encode(text, add_special_tokens=True)
        assert ours.encode(text) == expected, text
        assert ours.decode(expected) == ref.decode(expected, skip_special_tokens=True), text
    assert list(ours.eos_token_ids) == [ref.eos_token_id]
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.chat_template == ref.chat_template
    assert ours.vocab_size == len(ref)


def test_gguf_metadata(smollm2: ModelTokenizer) -> None:
    assert smollm2.context_length == 8192
    assert smollm2.eos_token_ids == (2,)
    assert smollm2.encode("<|im_end|>") == [2]
    assert 2 in smollm2.special_token_ids
    assert smollm2.id_bytes is not None and smollm2.id_bytes[2] == b""


@pytest.mark.timeout(30)
def test_conversion_is_cached_on_disk(gguf_path: Path, tmp_path: Path, monkeypatch) -> None:
    spec = f"gguf:{gguf_path}"
    monkeypatch.setattr(tokenizer_mod, "_cache", {})
    first = load_tokenizer(spec, cache_dir=tmp_path)
    [entry] = list(tmp_path.iterdir())
    assert (entry / "tokenizer.json").exists()
    assert json.loads((entry / "meta.json").read_text())["context_length"] == 8192

    def no_convert(path):
        raise AssertionError("GGUF re-read despite a cache entry")

    monkeypatch.setattr(tokenizer_mod, "_cache", {})
    monkeypatch.setattr("tandem.tokens.gguf.convert_gguf", no_convert)
    second = load_tokenizer(spec, cache_dir=tmp_path)
    assert second.encode("cache hit 🎉") == first.encode("cache hit 🎉")


def test_hf_dir_roundtrip(smollm2: ModelTokenizer, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text(smollm2.backend.to_str())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": "{{ messages[0]['content'] }}",
                "eos_token": "<|im_end|>",
                "bos_token": {"content": "<|im_start|>"},
            }
        )
    )
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    tok = load_tokenizer(f"hf:{tmp_path}")
    assert tok.eos_token_ids == (2,)
    assert tok.bos_token_id == 1
    assert tok.context_length == 2048
    assert tok.chat_template == "{{ messages[0]['content'] }}"
    text = "round trip 日本語"
    assert tok.encode(text) == smollm2.encode(text)


def test_unknown_source_names_choices() -> None:
    with pytest.raises(
        ValueError, match="unknown tokenizer source 'spm'; expected one of: gguf, hf"
    ):
        load_tokenizer("spm:/x")
    with pytest.raises(FileNotFoundError):
        load_tokenizer("gguf:/nonexistent/model.gguf")
