"""`tandem bench structured`: the cost of constrained decoding.

    tandem bench structured libraries   grammar libraries head to head on this CPU
    tandem bench structured engine      the native engine's per-token cost at batch 1 and 32

`libraries` times, for each of llguidance, xgrammar and outlines-core that is importable,
on the model's own vocabulary (SmolLM2: 49152 tokens): loading the vocabulary, compiling a
JSON schema (nested object, enum, bounded integers, array, pattern), and per token of a
valid document the mask fill (batch 1: one matcher; batch 32: 32 matchers at different
positions, the way an engine step sees them) and the advance. xgrammar and outlines-core are
not tandem dependencies: `pip install --no-deps xgrammar apache-tvm-ffi outlines-core` to
include them (xgrammar's declared deps would replace torch).

`engine` runs SmolLM2 decode steps at each --batch: unconstrained greedy rows, then the same
rows each under a JSON schema that never completes within the window, and reports the step
time of both, the share of the constrained step spent in the grammar (mask fill + apply +
matcher advance, timed inside the step) and the per-token cost in ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

if TYPE_CHECKING:  # torch and the engine load only for the subcommand that runs
    import torch

    from tandem.engines.native.engine_core import EngineCore
    from tandem.tokens.tokenizer import ModelTokenizer

T = TypeVar("T")
# a grammar library's own matcher (llguidance.LLMatcher, xgrammar.GrammarMatcher,
# outlines_core.Guide): objects of untyped third-party libraries
LibraryMatcher: TypeAlias = Any

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace, Countess of Lovelace",
    "age": 36,
    "role": "admin",
    "tags": ["mathematics", "poetry", "analytical engine", "notes"],
    "address": {"city": "London", "zip": "12345"},
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tandem bench structured", description=__doc__)
    p.add_argument("what", choices=["libraries", "engine"])
    p.add_argument("--model", default=None, help="a .gguf or HF dir (default: SmolLM2 GGUF)")
    p.add_argument("--repeats", type=int, default=3, help="libraries: passes over the document")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="engine: batch sizes")
    p.add_argument("--steps", type=int, default=24, help="engine: timed decode steps per batch")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    result = libraries(args) if args.what == "libraries" else engine(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


# ---------------------------------------------------------------------------- libraries
class Probe:
    """One library behind the four operations the comparison times."""

    name = ""

    def load(self, tok: ModelTokenizer) -> None:
        raise NotImplementedError

    def compile(self, schema: dict[str, Any]) -> LibraryMatcher:
        """A fresh matcher (compile included)."""
        raise NotImplementedError

    def fill(self, matchers: list[LibraryMatcher], bitmask: torch.Tensor) -> None:
        raise NotImplementedError

    def advance(self, matcher: LibraryMatcher, token: int) -> None:
        raise NotImplementedError


class LlguidanceProbe(Probe):
    name = "llguidance"

    def load(self, tok: ModelTokenizer) -> None:
        import llguidance

        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(
            tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=list(tok.eos_token_ids)
        )
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict[str, Any]) -> LibraryMatcher:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, {"whitespace_flexible": False}
        )
        return self.llg.LLMatcher(self.tokenizer, grammar)

    def fill(self, matchers: list[LibraryMatcher], bitmask: torch.Tensor) -> None:
        rows = [(m, i) for i, m in enumerate(matchers)]
        width = bitmask.shape[1] * 4
        self.executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), width, len(matchers))

    def advance(self, matcher: LibraryMatcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


class XgrammarProbe(Probe):
    name = "xgrammar"

    def load(self, tok: ModelTokenizer) -> None:
        import xgrammar

        self.xgr = xgrammar
        vocab = [tok.backend.id_to_token(i) or "" for i in range(tok.vocab_size)]
        info = xgrammar.TokenizerInfo(
            vocab,
            vocab_type=xgrammar.VocabType.BYTE_LEVEL,
            vocab_size=tok.vocab_size,
            stop_token_ids=list(tok.eos_token_ids),
        )
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, schema: dict[str, Any]) -> LibraryMatcher:
        compiled = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[LibraryMatcher], bitmask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def advance(self, matcher: LibraryMatcher, token: int) -> None:
        assert matcher.accept_token(token)


class OutlinesProbe(Probe):
    name = "outlines-core"

    def load(self, tok: ModelTokenizer) -> None:
        import outlines_core

        self.oc = outlines_core
        by_text: dict[str, list[int]] = {}
        for i in range(tok.vocab_size):
            if i not in tok.special_token_ids and (text := tok.backend.id_to_token(i)):
                by_text.setdefault(text, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(tok.eos_token_ids[0], by_text)

    def compile(self, schema: dict[str, Any]) -> LibraryMatcher:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), "")
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary))

    def fill(self, matchers: list[LibraryMatcher], bitmask: torch.Tensor) -> None:
        row = bitmask.shape[1]
        for i, m in enumerate(matchers):
            m.write_mask_into(bitmask[i].data_ptr(), row, 4)

    def advance(self, matcher: LibraryMatcher, token: int) -> None:
        matcher.advance(token)


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def libraries(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    tok = _tokenizer(args.model)
    ids = tok.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False)
    print(f"vocabulary {tok.vocab_size} tokens; document {len(ids)} tokens; schema: see module")
    print(
        f"{'library':14} {'vocab load':>10} {'compile':>9} {'mask b1 mean':>12} {'p50':>7} "
        f"{'p99':>8} {'advance':>8} {'mask b32/step':>13}  (ms, except µs per token)"
    )
    results: dict[str, Any] = {}
    for probe in (LlguidanceProbe(), XgrammarProbe(), OutlinesProbe()):
        try:
            _, load_s = _timed(lambda p=probe: p.load(tok))  # type: ignore[misc]
        except ImportError as exc:
            print(f"{probe.name:14} not installed ({exc.name}); skipped")
            continue
        words = (tok.vocab_size + 31) // 32
        bitmask = torch.full((32, words), -1, dtype=torch.int32)
        compile_s, mask_us, advance_us = _document_pass(probe, ids, bitmask, args.repeats)
        batch_ms = _batch32(probe, ids, bitmask)
        row = {
            "vocab_load_ms": load_s * 1e3,
            "compile_ms": statistics.median(compile_s) * 1e3,
            "mask_b1_mean_us": statistics.mean(mask_us),
            "mask_b1_p50_us": statistics.median(mask_us),
            "mask_b1_p99_us": _pct(mask_us, 0.99),
            "advance_mean_us": statistics.mean(advance_us),
            "mask_b32_step_ms": batch_ms,
        }
        results[probe.name] = row
        print(
            f"{probe.name:14} {row['vocab_load_ms']:10.0f} {row['compile_ms']:9.1f} "
            f"{row['mask_b1_mean_us']:12.1f} {row['mask_b1_p50_us']:7.1f} "
            f"{row['mask_b1_p99_us']:8.1f} {row['advance_mean_us']:8.1f} {batch_ms:13.2f}"
        )
    return {"vocab_size": tok.vocab_size, "document_tokens": len(ids), "libraries": results}


def _document_pass(
    probe: Probe, ids: list[int], bitmask: torch.Tensor, repeats: int
) -> tuple[list[float], list[float], list[float]]:
    """Compile seconds per repeat; µs of every mask fill and advance over the document."""
    compile_s: list[float] = []
    mask_us: list[float] = []
    advance_us: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        matcher = probe.compile(SCHEMA)
        compile_s.append(time.perf_counter() - start)
        for t in ids:
            start = time.perf_counter()
            probe.fill([matcher], bitmask)
            mid = time.perf_counter()
            probe.advance(matcher, t)
            mask_us.append((mid - start) * 1e6)
            advance_us.append((time.perf_counter() - mid) * 1e6)
    return compile_s, mask_us, advance_us


def _batch32(probe: Probe, ids: list[int], bitmask: torch.Tensor) -> float:
    """Mean ms to fill 32 masks whose matchers sit at 32 different points of the document."""
    matchers = []
    for k in range(32):
        m = probe.compile(SCHEMA)
        for t in ids[: k * len(ids) // 32]:
            probe.advance(m, t)
        matchers.append(m)
    times = []
    for _ in range(10):
        _, s = _timed(lambda: probe.fill(matchers, bitmask))
        times.append(s)
    return statistics.median(times) * 1e3


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _tokenizer(model: str | None) -> ModelTokenizer:
    from tandem.engines.native.engine import tokenizer_spec
    from tandem.engines.native.loader import default_model_path
    from tandem.tokens.tokenizer import load_tokenizer

    spec = tokenizer_spec(model or default_model_path())
    assert spec is not None
    return load_tokenizer(spec)


# ---------------------------------------------------------------------------- engine
def engine(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from tandem.engines.native.config import NativeConfig
    from tandem.engines.native.engine import build_core

    torch.set_num_threads(args.num_threads)
    config = NativeConfig(model=args.model, num_threads=args.num_threads, num_blocks=2048)
    core, _ = build_core(config)
    timer = _GrammarTimer(core)
    tok = _tokenizer(args.model)
    core.grammars.tokenizer()  # the vocabulary loads once, before any timing
    # an array of objects that cannot close inside the window: every step stays constrained
    schema = {"type": "array", "items": SCHEMA, "minItems": 1000}
    prompt = tok.encode("A list of people as JSON:", add_special_tokens=True)
    print(f"native engine, {args.num_threads} threads; {args.steps} decode steps per row")
    print(
        f"{'batch':>5} {'plain step':>10} {'constrained step':>16} {'grammar/step':>12} "
        f"{'share':>6} {'grammar/token':>13}  (ms)"
    )
    rows = []
    for batch in args.batch:
        plain = _decode_ms(core, prompt, batch, args.steps, None, timer)
        constrained = _decode_ms(core, prompt, batch, args.steps, json.dumps(schema), timer)
        grammar_ms = timer.total_s * 1e3 / args.steps
        row = {
            "batch": batch,
            "plain_step_ms": plain,
            "constrained_step_ms": constrained,
            "grammar_ms_per_step": grammar_ms,
            "grammar_share": grammar_ms / constrained,
            "grammar_ms_per_token": grammar_ms / batch,
            "overhead_ms_per_token": (constrained - plain) / batch,
        }
        rows.append(row)
        print(
            f"{batch:5d} {plain:10.1f} {constrained:16.1f} {grammar_ms:12.2f} "
            f"{row['grammar_share']:6.1%} {row['grammar_ms_per_token']:13.3f}"
        )
    print(
        "grammar = bitmask fill + one masking pass over the batch logits + matcher advance; "
        "a constrained step also computes full fp32 logits (plain greedy may screen in bf16)"
    )
    return {"rows": rows}


class _GrammarTimer:
    """Wraps the core's mask pass and matcher advance with wall-clock accounting."""

    def __init__(self, core: EngineCore) -> None:
        from tandem.engines.native import engine_core
        from tandem.engines.native.structured import advance

        self.total_s = 0.0
        masks = core.runner.grammar_masks
        apply = masks.apply

        def timed_apply(logits: torch.Tensor, matchers: list[LibraryMatcher]) -> None:
            start = time.perf_counter()
            apply(logits, matchers)
            self.total_s += time.perf_counter() - start

        def timed_advance(matcher: LibraryMatcher, token: int) -> tuple[bool, bool]:
            start = time.perf_counter()
            out = advance(matcher, token)
            self.total_s += time.perf_counter() - start
            return out

        masks.apply = timed_apply  # type: ignore[method-assign]
        vars(engine_core)["advance"] = timed_advance  # the name _append calls


def _decode_ms(
    core: EngineCore,
    prompt: list[int],
    batch: int,
    steps: int,
    spec: str | None,
    timer: _GrammarTimer,
) -> float:
    """Median ms of `steps` decode steps of `batch` greedy rows (after prefill + 2 warm-up)."""
    from tandem.protocols.engine import (
        PreprocessedRequest,
        SamplingParams,
        StopConditions,
        StructuredOutput,
    )

    structured = None if spec is None else StructuredOutput(kind="json_schema", spec=spec)
    for i in range(batch):
        core.add(
            PreprocessedRequest(
                request_id=f"b{batch}-{i}-{spec is not None}",
                model="bench",
                token_ids=[*prompt, i + 100],  # distinct rows, shared prefix
                sampling=SamplingParams(temperature=0.0, structured=structured),
                stop=StopConditions(max_tokens=steps + 8, ignore_eos=True),
            )
        )
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in core.seqs.values()):
        core.step()
    core.step()
    core.step()
    timer.total_s = 0.0
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    for rid in list(core.seqs):
        core.abort(rid)
    core.step()
    return statistics.median(times) * 1e3
