"""Weight loading: a GGUF written the way llama.cpp converts (Q/K rows permuted) loads back
to the HF layout; HF dirs round-trip and agree with transformers; bad files fail clearly."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from native_tiny import TINY, TINY_WEIGHTS

from tandem.engines.native.attention import AttentionMetadata, PrefillSpan
from tandem.engines.native.gguf_loader import GgufFormatError
from tandem.engines.native.loader import load_gguf, load_hf_dir, load_model_weights, save_hf_dir
from tandem.engines.native.model import LlamaModel

pytestmark = pytest.mark.timeout(30)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert script does to Q/K rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(path, skip: str | None = None, arch: str = "llama") -> None:
    c = TINY
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_layers)
    writer.add_context_length(c.context_length)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_eos_token_id(2)
    names = {"embed_tokens": "token_embd", "norm": "output_norm"}
    layer = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for hf, w in TINY_WEIGHTS.items():
        parts = hf.split(".")
        if parts[1] == "layers":
            name = f"blk.{parts[2]}.{layer['.'.join(parts[3:-1])]}.weight"
        else:
            name = f"{names[parts[1]]}.weight"
        array = w.numpy()
        if "q_proj" in hf:
            array = llama_cpp_permute(array, c.num_heads)
        elif "k_proj" in hf:
            array = llama_cpp_permute(array, c.num_kv_heads)
        if name != skip:
            writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_loads_back_to_hf_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    write_gguf(tmp_path / "tiny.gguf")
    for _ in range(2):  # converted, then from the cache
        config, weights = load_gguf(str(tmp_path / "tiny.gguf"))
        assert config.num_heads == 4 and config.num_kv_heads == 2 and config.eos_token_ids == (2,)
        assert config.tie_word_embeddings and config.head_dim == 16
        assert weights.keys() == TINY_WEIGHTS.keys()
        for name, w in TINY_WEIGHTS.items():
            assert torch.equal(weights[name], w), name
    assert list((tmp_path / "cache").rglob("*.safetensors"))


def test_missing_tensor_names_file_and_tensor(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "broken.gguf"
    write_gguf(path, skip="blk.1.attn_k.weight")
    with pytest.raises(
        GgufFormatError, match=r"broken\.gguf: missing tensor 'blk\.1\.attn_k\.weight'"
    ):
        load_gguf(str(path))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(GgufFormatError, match=r"junk\.gguf"):
        load_gguf(str(tmp_path / "junk.gguf"))
    with pytest.raises(FileNotFoundError, match=r"nowhere\.gguf"):
        load_model_weights(str(tmp_path / "nowhere.gguf"))


def test_hf_dir_round_trip_agrees_with_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    save_hf_dir(TINY, TINY_WEIGHTS, str(tmp_path / "tiny"))
    _, config, weights = load_model_weights(str(tmp_path / "tiny"))
    assert config.to_hf() == TINY.to_hf() | {"eos_token_id": [2]}
    assert all(torch.equal(weights[k], v) for k, v in TINY_WEIGHTS.items())
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "tiny")).eval()
    ids = torch.tensor([5, 17, 99, 3, 200, 41, 7])
    with torch.inference_mode():
        expected = hf(ids[None]).logits[0]
    model = LlamaModel(config, weights)
    n = len(ids)
    pos = torch.arange(n)
    meta = AttentionMetadata(
        slot_mapping=pos,
        cos=model.cos[pos].unsqueeze(1),
        sin=model.sin[pos].unsqueeze(1),
        prefills=[
            PrefillSpan(start=0, end=n, ctx_len=n, context_blocks=torch.arange(2), mask=None)
        ],
    )
    with torch.inference_mode():
        got = model.forward(ids, meta, model.new_kv_cache(2, 4), pos)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_hf_dir_missing_tensor(tmp_path):
    weights = {k: v for k, v in TINY_WEIGHTS.items() if "layers.0.mlp.up" not in k}
    save_hf_dir(TINY, weights, str(tmp_path / "bad"))
    with pytest.raises(
        GgufFormatError, match=r"missing tensor 'model\.layers\.0\.mlp\.up_proj\.weight'"
    ):
        load_hf_dir(str(tmp_path / "bad"))
