"""EPD (issue 15): `tandem serve --engine native --workers 2 --router kv` as a real process tree,
with no encode workers, answering chat requests about real photos from scikit-image's data folder
through the classifier-bridge encoder in each worker.

Shown here: the cat and the coffee photos get different answers, naming what they show; a
repeated image is served from the prefix cache (cached_tokens past the image rows) by the worker
that holds it; a different image with the same text shares no block that overlaps image rows;
file:// and data: URLs of the same picture share the cache (mm_hash is of the pixels); and every
bad input is a 400 naming the part and the limit."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from tests.support.images import data_url, photo_bytes, skimage_data_dir, synthetic_png
from tests.support.services import free_port
from tests.support.smollm2 import smollm2_gguf
from tests.support.tandem_procs import (
    MODEL,
    TandemProcess,
    http_request,
    start_tandem,
    wait_instances,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]  # the first test starts 2 workers

QUESTION = "What is in this picture?"
ROUTED = re.compile(
    r'^tandem_router_routed_requests_total\{worker_id="([^"]+)"[^}]*\} (\d+)$', re.M
)
MAX_IMAGE_BYTES = 600_000  # astronaut.png (792 kB) is over it, the others under
BLOCK = 16


class Served:
    def __init__(self, proc: TandemProcess, base_url: str, image_dir: Path) -> None:
        self.proc, self.base_url, self.image_dir = proc, base_url, image_dir

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        status, _, raw = http_request(f"{self.base_url}{path}", body, timeout_s=120)
        return status, json.loads(raw)

    def routed(self) -> dict[str, int]:
        _, _, raw = http_request(f"{self.base_url}/metrics")
        return {w: int(n) for w, n in ROUTED.findall(raw.decode())}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("mm")
    image_dir = tmp / "images"
    image_dir.mkdir()
    shutil.copy(skimage_data_dir() / "chelsea.png", image_dir / "cat.png")
    port = free_port()
    args = ["serve", "--engine", "native", "--workers", "2", "--router", "kv"]
    args += ["--port", str(port), "--run-dir", str(tmp / "run"), "--log-level", "INFO"]
    args += ["--mm-allowed-local-dir", str(image_dir), "--mm-allowed-hosts", "localhost"]
    args += ["--mm-max-image-bytes", str(MAX_IMAGE_BYTES), "--mm-max-images-per-request", "3"]
    args += ["--kv-cache-memory-gb", "0.25", "--max-num-seqs", "8"]  # passed to the workers
    proc = start_tandem("serve", args, tmp)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_instances(base, lambda ids: len(ids) == 2, timeout_s=240, proc=proc)
        yield Served(proc, base, image_dir)
    finally:
        code = proc.stop()
        log = proc.log()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-5000:]


def _image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _photo_url(name: str) -> str:
    return data_url(photo_bytes(name), "image/jpeg" if name.endswith(".jpg") else "image/png")


def _ask(served: Served, *images: str, question: str = QUESTION, max_tokens: int = 24):
    parts = [_image_part(u) for u in images] + [{"type": "text", "text": question}]
    body = {"model": MODEL, "temperature": 0, "max_tokens": max_tokens}
    body["messages"] = [{"role": "user", "content": parts}]
    before = served.routed()
    status, out = served.post("/v1/chat/completions", body)
    assert status == 200, out
    after = served.routed()
    workers = [w for w in after if after[w] != before.get(w, 0)]
    return out["choices"][0]["message"]["content"], out["usage"], workers


def _image_offset() -> int:
    """Where the image rows start in a one-image prompt (the rendered frame, tokenized)."""
    from tandem.tokens.chat_template import ChatTemplate
    from tandem.tokens.tokenizer import load_tokenizer

    tok = load_tokenizer(f"gguf:{smollm2_gguf()}")
    text = ChatTemplate(tok.chat_template).render(
        [{"role": "user", "content": "Picture: <empty_output>\n" + QUESTION}]
    )
    return tok.encode(text, add_special_tokens=False).index(16)


def test_answers_name_the_photo_and_differ(served: Served) -> None:
    cat, cat_usage, _ = _ask(served, _photo_url("chelsea.png"))
    coffee, _, _ = _ask(served, _photo_url("coffee.png"))
    assert cat != coffee
    assert "cat" in cat.lower(), cat
    assert any(w in coffee.lower() for w in ("coffee", "espresso", "cup", "mug")), coffee
    assert cat_usage["prompt_tokens"] > 50  # the image's 50 rows are prompt tokens


def test_repeated_image_hits_the_cache_on_the_worker_holding_it(served: Served) -> None:
    offset = _image_offset()
    first, _, [worker] = _ask(served, _photo_url("rocket.jpg"))
    again, usage, [worker_again] = _ask(served, _photo_url("rocket.jpg"))
    assert again == first
    assert worker_again == worker
    assert usage["prompt_tokens_details"]["cached_tokens"] >= (offset + 50) // BLOCK * BLOCK
    # the same picture from a file:// URL (same pixels, same mm_hash) reuses the data: URL KV
    cat_data, _, [cat_worker] = _ask(served, _photo_url("chelsea.png"))
    cat_file, usage, [file_worker] = _ask(served, f"file://{served.image_dir / 'cat.png'}")
    assert cat_file == cat_data and file_worker == cat_worker
    assert usage["prompt_tokens_details"]["cached_tokens"] >= (offset + 50) // BLOCK * BLOCK


def test_different_image_same_text_shares_no_image_block(served: Served) -> None:
    offset = _image_offset()
    _ask(served, _photo_url("retina.jpg"))
    _, usage, _ = _ask(served, _photo_url("hubble_deep_field.jpg"))
    # only the text blocks before the image can be shared
    assert usage["prompt_tokens_details"]["cached_tokens"] <= offset // BLOCK * BLOCK


def test_several_images_and_concurrent_requests_match_sequential(served: Served) -> None:
    pair = (_photo_url("chelsea.png"), _photo_url("coffee.png"))
    both, usage, _ = _ask(served, *pair, question="What are these two pictures?")
    assert usage["prompt_tokens"] > 100
    alone = [_ask(served, u)[0] for u in pair]
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda u: _ask(served, u)[0], pair))
    assert together == alone
    assert both not in alone


def _bad(served: Served, parts: list[dict[str, Any]], match: str, param: str | None) -> None:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": parts}]}
    status, out = served.post("/v1/chat/completions", body)
    assert status == 400, out
    assert re.search(match, out["error"]["message"]), out
    if param is not None:
        assert out["error"]["param"] == param, out


def test_bad_inputs_are_400s_naming_the_part(served: Served) -> None:
    text = {"type": "text", "text": QUESTION}
    png = synthetic_png(seed=1)
    _bad(served, [text, _image_part("data:image/png;base64,iVBOR#w0K")], "not valid base64",
         "messages[0].content[1]")  # fmt: skip
    _bad(served, [_image_part(data_url(png, "image/gif"))], "MIME type 'image/gif'", None)
    gif = photo_bytes("no_time_for_that_tiny.gif")
    _bad(served, [_image_part(data_url(gif))], "unsupported image format 'GIF'", None)
    _bad(served, [_image_part(data_url(b"\x89PNG\r\n\x1a\nnot really"))], "cannot decode", None)
    _bad(served, [_image_part(_photo_url("astronaut.png"))],
         rf"over the limit of {MAX_IMAGE_BYTES} bytes \(--mm-max-image-bytes\)", None)  # fmt: skip
    four = [_image_part(data_url(synthetic_png(seed=i))) for i in range(4)]
    _bad(served, [text, *four], r"has 4 images; the limit is 3", "messages[0].content[4]")
    outside = skimage_data_dir() / "chelsea.png"
    _bad(served, [_image_part(f"file://{outside}")], "outside the allowed directory", None)
    _bad(served, [_image_part("http://localhost:9/cat.png")], "private/loopback", None)
    _bad(served, [_image_part("https://example.com/cat.png")], "'example.com' is not allowed", None)
    _bad(served, [_image_part("ftp://x/cat.png")], "scheme 'ftp' is not supported", None)


def test_completions_are_text_only(served: Served) -> None:
    body = {"model": MODEL, "max_tokens": 4, "prompt": [_image_part(_photo_url("coffee.png"))]}
    status, out = served.post("/v1/completions", body)
    assert status == 400
    assert "/v1/completions takes text prompts or token ids only" in out["error"]["message"]
