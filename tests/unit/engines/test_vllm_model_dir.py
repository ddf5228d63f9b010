"""`tandem convert`: the SmolLM2 GGUF as a HF folder that transformers loads, with the same
greedy tokens as the native engine on the GGUF, the same tokenizer and chat template."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.engines.native.config import NativeConfig
from tandem.engines.native.engine import NativeEngine
from tandem.engines.vllm import model_dir
from tandem.engines.vllm.model_dir import ensure_hf_dir
from tandem.protocols.engine import PreprocessedRequest, SamplingParams, StopConditions
from tandem.tokens.tokenizer import ModelTokenizer, load_tokenizer

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a robot"]
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> Path:
    out = tmp_path_factory.mktemp("convert") / "smollm2-hf"
    subprocess.run(
        [sys.executable, "-m", "tandem.cli", "convert", str(gguf_path), "--out", str(out)],
        check=True,
        timeout=240,
    )
    return out


def test_folder_has_what_vllm_and_transformers_read(hf_dir: Path, smollm2: ModelTokenizer):
    names = {p.name for p in hf_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "generation_config.json" in names
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["eos_token_id"] == 2
    hf_tok = load_tokenizer(f"hf:{hf_dir}")
    assert hf_tok.chat_template == smollm2.chat_template and hf_tok.eos_token_ids == (2,)
    for text in PROMPTS:
        assert hf_tok.encode(text) == smollm2.encode(text)


async def test_transformers_greedy_equals_native_engine(
    hf_dir: Path, gguf_path: Path, smollm2: ModelTokenizer
):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    engine = NativeEngine(NativeConfig(model=str(gguf_path), num_blocks=64))
    await engine.start()
    try:
        for i, text in enumerate(PROMPTS):
            ids = smollm2.encode(text)
            assert tokenizer(text)["input_ids"] == ids
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([ids]), max_new_tokens=NUM_TOKENS, do_sample=False
                )
            expected = out[0, len(ids) :].tolist()
            request = PreprocessedRequest(
                request_id=f"r{i}",
                model="smollm2",
                token_ids=ids,
                sampling=SamplingParams(temperature=0.0),
                stop=StopConditions(max_tokens=NUM_TOKENS, ignore_eos=True),
            )
            got: list[int] = []
            async for chunk in engine.generate(request):
                got += chunk.token_ids
            assert got == expected, text
    finally:
        await engine.stop()


def test_ensure_hf_dir_converts_once_and_passes_dirs_through(
    hf_dir: Path, gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    assert ensure_hf_dir(str(hf_dir)) == str(hf_dir)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    calls: list[str] = []

    def fake_convert(gguf: str, out: str) -> Path:  # the real one ran in the fixture
        calls.append(gguf)
        shutil.copytree(hf_dir, out)
        return Path(out)

    monkeypatch.setattr(model_dir, "convert_gguf_to_hf", fake_convert)
    first = ensure_hf_dir(str(gguf_path))
    assert ensure_hf_dir(str(gguf_path)) == first and calls == [str(gguf_path)]
    assert Path(first, "model.safetensors").exists()
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf"):
        ensure_hf_dir(str(tmp_path / "nope.gguf"))
