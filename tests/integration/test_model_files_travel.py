"""Model files travel with a worker's registration (issue 30 item 3): a frontend whose host
lacks the tokenizer's path loads it from the files the worker put in the cluster's blob store;
a missing file is a 503 naming the model and the file (before: a bare 500 "internal error")."""

from __future__ import annotations

import shutil
from contextlib import AsyncExitStack
from pathlib import Path

import msgspec
import pytest
from tests.support.frontend_stack import CHAT, FrontendStack, start_frontend_task
from tests.support.smollm2 import smollm2_gguf

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.frontend.config import FrontendConfig
from tandem.protocols.discovery import ModelCard, ModelFile
from tandem.tokens.model_files import tokenizer_files, tokenizer_from_files
from tandem.tokens.tokenizer import load_tokenizer

pytestmark = pytest.mark.timeout(120)
BODY = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi there!"}],
        "max_tokens": 4}  # fmt: skip


def test_the_files_rebuild_the_same_tokenizer() -> None:
    tok = load_tokenizer(f"gguf:{smollm2_gguf()}")
    again = tokenizer_from_files(tokenizer_files(tok))
    for text in ("Hello, world!", "héllo 𝄞 <|im_start|>user\nx<|im_end|>", "  spaces\t\ttabs"):
        assert again.backend.encode(text).ids == tok.backend.encode(text).ids
    assert (again.chat_template, again.eos_token_ids, again.bos_token_id) == (
        tok.chat_template, tok.eos_token_ids, tok.bos_token_id)  # fmt: skip
    assert again.id_bytes == tok.id_bytes
    with pytest.raises(ValueError, match=r"tokenizer_meta\.json is missing"):
        tokenizer_from_files({"tokenizer.json": b"{}"})
    with pytest.raises(ValueError, match=r"tokenizer\.json does not parse"):
        tokenizer_from_files({"tokenizer.json": b"not json", "tokenizer_meta.json": b"{}"})


async def test_a_frontend_without_the_models_path_serves_from_the_registration(
    tmp_path: Path,
) -> None:
    copy = tmp_path / "model" / "smollm2.gguf"
    copy.parent.mkdir()
    shutil.copy(smollm2_gguf(), copy)
    async with AsyncExitStack() as stack:
        s = FrontendStack(stack)
        config = MockerConfig(num_blocks=256, block_size=16, speedup_ratio=0,
                              tokenizer=f"gguf:{copy}")  # fmt: skip
        worker = await s.add_worker(MockerEngine(config))
        assert worker.instance is not None and worker.instance.model is not None
        assert set(worker.instance.model.files) == {"tokenizer.json", "tokenizer_meta.json"}
        shutil.rmtree(copy.parent)  # the frontend's "host" has no model files
        await s.start_frontend(BODY)
        status, body, _ = await s.post(CHAT, BODY)
        assert status == 200, body


async def test_a_missing_model_file_is_a_503_naming_the_model_and_the_file(
    tmp_path: Path,
) -> None:
    async with AsyncExitStack() as stack:
        s = FrontendStack(stack)
        worker = await s.add_worker(MockerEngine(MockerConfig(
            num_blocks=64, block_size=16, speedup_ratio=0,
            tokenizer=f"gguf:{tmp_path / 'gone.gguf'}")))  # fmt: skip
        assert worker.instance is not None and worker.instance.model is not None
        assert worker.instance.model.files == {}  # the worker could not read it either
        files = {"tokenizer.json": ModelFile(sha256="ab" * 32, size=10),
                 "tokenizer_meta.json": ModelFile(sha256="cd" * 32, size=2)}  # fmt: skip
        lost = ModelCard(name="lost", context_length=2048, block_size=16, num_total_blocks=64,
                         tokenizer=f"gguf:{tmp_path / 'elsewhere.gguf'}", files=files)  # fmt: skip

        async def handler(payload: bytes, ctx: object):  # never reached: the model fails first
            yield b""

        await s.add_handler(handler, lost)
        rt = await s.runtime()
        s.base, s.http = await start_frontend_task(stack, rt, FrontendConfig(port=0))
        for model, named in (("smollm2", "gone.gguf"), ("lost", "tokenizer.json")):
            for _ in range(200):
                status, body, _ = await s.post(CHAT, {**BODY, "model": model})
                if status != 404:  # the frontend has not seen the model yet
                    break
            assert status == 503, body
            message = msgspec.json.encode(body).decode()
            assert f"model '{model}'" in message and named in message, body
