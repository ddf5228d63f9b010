"""Native engine with images (DESIGN.md §10): image rows take the request's embedding rows
instead of token embeddings — exact against an unpaged reference, the same alone, batched and
chunked, and prefix-cached under mm-aware block hashes."""

from __future__ import annotations

import asyncio

import pytest
import torch
from native_reference import TIE_GAP, reference_logits
from native_tiny import TINY, TINY_WEIGHTS, request, tiny_core

from tandem.engines.native.engine import NativeEngine
from tandem.engines.native.engine_core import EngineCore
from tandem.errors import InvalidRequest
from tandem.protocols.engine import EngineOutput, MmItem, PreprocessedRequest
from tandem.protocols.kv_events import BlockStored
from tandem.tokens.hashing import sequence_hashes

pytestmark = pytest.mark.timeout(60)

PH, ROWS = 16, 6  # placeholder id; rows per image


def image_rows(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, TINY.hidden_size, generator=g)


def mm_request(
    rid: str, images: list[int], *, text_before: int = 3, text_after: int = 5, max_tokens: int = 6
) -> tuple[PreprocessedRequest, list[torch.Tensor]]:
    """[text][image rows][text][image rows]...[text]: each seed in `images` one image."""
    ids = [40 + i for i in range(text_before)]
    items = []
    for seed in images:
        items.append(MmItem(mm_hash=1000 + seed, offset=len(ids), num_tokens=ROWS))
        ids += [PH] * ROWS + [60 + seed]
    ids += [70 + i for i in range(text_after)]
    req = request(rid, ids, max_tokens=max_tokens)
    req.mm_items = items
    return req, [image_rows(s) for s in images]


def run(core: EngineCore, reqs: list[tuple[PreprocessedRequest, list[torch.Tensor]]]):
    for req, emb in reqs:
        core.add(req, emb)
    tokens: dict[str, list[int]] = {req.request_id: [] for req, _ in reqs}
    first: dict[str, EngineOutput] = {}
    while core.has_work():
        for rid, out in core.step():
            first.setdefault(rid, out)
            tokens[rid] += out.token_ids
    core.block_manager.check_integrity()
    return tokens, first


def check_against_reference(req: PreprocessedRequest, emb: list[torch.Tensor], out: list[int]):
    embeds = {
        item.offset + r: e[r]
        for item, e in zip(req.mm_items, emb, strict=True)
        for r in range(ROWS)
    }
    logits = reference_logits(TINY, TINY_WEIGHTS, req.token_ids + out[:-1], embeds)
    for j, token in enumerate(out):
        row = logits[len(req.token_ids) - 1 + j]
        gap = float(row.max() - row[token])
        assert gap < TIE_GAP, f"token {j}: engine {token}, reference {int(row.argmax())}"


def test_image_rows_replace_token_embeddings_exactly() -> None:
    req, emb = mm_request("a", [1, 2])
    tokens, _ = run(tiny_core(), [(req, emb)])
    check_against_reference(req, emb, tokens["a"])
    # the embeddings are what the model reads: other rows, other answer (placeholders alone too)
    other, _ = run(tiny_core(), [mm_request("b", [3, 4])])
    plain = request("c", req.token_ids, max_tokens=6)
    text_only, _ = run(tiny_core(), [(plain, [])])
    assert tokens["a"] != other["b"] and tokens["a"] != text_only["c"]


@pytest.mark.parametrize("budget", [4, 5, 7, 64])
def test_same_output_alone_batched_and_chunked_across_image_boundaries(budget: int) -> None:
    alone, _ = run(tiny_core(), [mm_request("a", [1, 2])])
    mixed = [
        mm_request("a", [1, 2]),
        (request("t", [5, 6, 7, 8, 9, 10, 11], max_tokens=6), []),
        mm_request("b", [3], text_before=6),
    ]
    together, _ = run(tiny_core(max_num_batched_tokens=budget), mixed)
    assert together["a"] == alone["a"]
    req, emb = mixed[2]
    check_against_reference(req, emb, together["b"])


def test_prefix_cache_reuses_the_same_image_and_never_another() -> None:
    core = tiny_core()
    req, emb = mm_request("a", [1], text_before=8)  # block 0,1 text; image rows 8..13
    first, _ = run(core, [(req, emb)])
    again, outs2 = run(core, [mm_request("a2", [1], text_before=8)])
    assert again["a2"] == first["a"]
    assert outs2["a2"].num_cached_tokens == 16  # every full prompt block (prompt is 19 tokens)
    other, outs3 = run(core, [mm_request("b", [2], text_before=8)])
    assert outs3["b"].num_cached_tokens == 8  # the text blocks before the image only
    check_against_reference(*mm_request("b", [2], text_before=8), other["b"])


def test_kv_events_carry_mm_aware_hashes() -> None:
    core = tiny_core()
    req, emb = mm_request("a", [1], text_before=8)
    run(core, [(req, emb)])
    stored = [
        h for ev in core.take_events() if isinstance(ev, BlockStored) for h in ev.block_hashes
    ]
    expected = sequence_hashes(req.token_ids, 4, mm_items=req.mm_items)
    assert stored[: len(expected)] == expected
    assert expected != sequence_hashes(req.token_ids, 4)  # the image changed the hashes


def test_requests_with_images_need_embeddings_of_the_right_shape() -> None:
    core = tiny_core()
    req, _ = mm_request("a", [1])
    with pytest.raises(InvalidRequest, match="has 1 images and no embeddings"):
        core.add(req)
    with pytest.raises(InvalidRequest, match=r"embedding shape \(6, 3\); expected \[6, 64\]"):
        core.add(req, [torch.zeros(ROWS, 3)])
    bad = request("b", [PH] * 4)
    bad.mm_items = [MmItem(mm_hash=1, offset=2, num_tokens=4)]
    with pytest.raises(InvalidRequest, match="ends at 6, past the prompt's 4 tokens"):
        core.check(bad)
    bad.mm_items = [
        MmItem(mm_hash=1, offset=0, num_tokens=2),
        MmItem(mm_hash=2, offset=1, num_tokens=2),
    ]
    with pytest.raises(InvalidRequest, match="overlaps the previous image"):
        core.check(bad)


def test_recompute_without_embeddings_fails_the_request_not_the_engine() -> None:
    core = tiny_core()
    req, emb = mm_request("a", [1])
    seq = core.add(req, emb)
    seq.mm_embeddings = []  # as a decode worker's sequence received as KV, then preempted
    other = core.add(request("t", [5, 6, 7]), None)
    outputs = core.step()
    errors = [out for rid, out in outputs if rid == "a"]
    assert errors and errors[0].finish_reason == "error" and "image rows" in (errors[0].error or "")
    assert other.num_computed_tokens == 3  # the other request ran
    assert "a" not in core.seqs
    core.block_manager.check_integrity()


class _Provider:
    def __init__(self) -> None:
        self.calls = 0

    async def embeddings(self, request: PreprocessedRequest) -> list[torch.Tensor]:
        self.calls += 1
        return [image_rows(item.mm_hash - 1000) for item in request.mm_items]


async def test_engine_asks_its_provider_and_matches_the_core() -> None:
    core = tiny_core()
    provider = _Provider()
    engine = NativeEngine(core.config, core=core, embedding_provider=provider)
    info = await engine.start()
    assert (info.mm_num_tokens_per_image, info.mm_placeholder_token_id) == (50, 16)

    async def collect(req: PreprocessedRequest) -> list[int]:
        return [t async for out in engine.generate(req) for t in out.token_ids]

    reqs = [mm_request(f"r{i}", [i, i + 1])[0] for i in range(3)]
    outs = await asyncio.gather(*(collect(r) for r in reqs))
    await engine.stop()
    assert provider.calls == 3
    expected, _ = run(tiny_core(), [mm_request(f"r{i}", [i, i + 1]) for i in range(3)])
    assert outs == [expected[f"r{i}"] for i in range(3)]


async def test_engine_without_encoder_refuses_images() -> None:
    core = tiny_core(mm_encoder=None)
    engine = NativeEngine(core.config, core=core)
    info = await engine.start()
    assert info.mm_num_tokens_per_image == 0
    with pytest.raises(InvalidRequest, match="runs no vision encoder"):
        async for _ in engine.generate(mm_request("a", [1])[0]):
            pass
    await engine.stop()
