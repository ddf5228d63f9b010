"""Constrained decoding (SamplingParams.structured) for the native engine, with llguidance.

Each constrained sequence owns an `LLMatcher` (`Sequence.grammar`) built from its
StructuredOutput and fast-forwarded over the tokens it already produced elsewhere
(the request's `num_generated_tokens`: a disaggregated prefill's first token, a migrated
stream's tokens). Per step, `GrammarMasks.apply` fills one int32 bitmask
[rows, ceil(vocab/32)] for the batch (llguidance's executor, native threads, GIL released) and
applies it to the batch's logits in one pass (numpy putmask of the unpacked, inverted words);
unconstrained rows keep every bit set, and a batch without constrained rows returns before
touching anything. EOS is in a row's mask only when
its grammar accepts; `advance` reports a grammar that can take nothing more so the engine
finishes the sequence at once instead of spending a step on the forced EOS.

Why llguidance (not xgrammar or outlines-core): `tandem bench structured libraries`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import llguidance
import numpy as np
import torch

from tandem.errors import InvalidRequest
from tandem.protocols.engine import StructuredOutput
from tandem.tokens.grammar import grammar_text
from tandem.tokens.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class GrammarCompiler:
    """Builds per-sequence matchers over one model's vocabulary. Thread-safe: the engine's
    async side compiles off the step thread; the step thread may compile too (direct
    `EngineCore.add`). The vocabulary (about a second for 49k tokens) loads on first use."""

    def __init__(
        self, tokenizer_spec: str | None, vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> None:
        self.tokenizer_spec = tokenizer_spec
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._lock = threading.Lock()
        self._tokenizer: Any = None

    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._load()
            return self._tokenizer

    def _load(self) -> Any:

        if self.tokenizer_spec is None:
            raise InvalidRequest(
                "structured output needs the model's tokenizer; this engine has none "
                "(load a GGUF or HF directory with tokenizer.json)"
            )
        tok = load_tokenizer(self.tokenizer_spec)
        return llguidance.LLTokenizer(
            tok.backend.to_str(),
            n_vocab=self.vocab_size,
            eos_token=list(self.eos_token_ids or tok.eos_token_ids),
        )

    def matcher(
        self, structured: StructuredOutput, token_ids: list[int], num_generated: int = 0
    ) -> Any:
        """A matcher for `structured`, advanced over the last `num_generated` of `token_ids`
        (generated elsewhere under it). Raises InvalidRequest for a grammar that does not
        compile or tokens it rejects."""
        tokenizer = self.tokenizer()
        try:
            matcher = llguidance.LLMatcher(tokenizer, grammar_text(structured))
        except ValueError as exc:
            raise InvalidRequest(f"structured output does not compile: {exc}") from exc
        if matcher.is_error():
            raise InvalidRequest(f"structured output does not compile: {matcher.get_error()}")
        n = num_generated
        if n:
            if not 0 < n <= len(token_ids):
                raise InvalidRequest(
                    f"num_generated_tokens={n} is invalid; expected at most the "
                    f"{len(token_ids)} tokens of the request"
                )
            if not matcher.consume_tokens(token_ids[-n:]):
                raise InvalidRequest(
                    f"the {n} tokens already generated do not match the structured output: "
                    f"{matcher.get_error()}"
                )
        return matcher


def advance(matcher: Any, token: int) -> tuple[bool, bool]:
    """Feed the sampled token to the matcher: (accepted, finished). `finished` is True when
    the grammar can take nothing but EOS now (the sequence should stop)."""
    if matcher.is_stopped():
        return True, True
    if not matcher.consume_token(token):
        return False, True
    return True, matcher.is_stopped()


class GrammarMasks:
    """The per-step bitmask buffer and the executor that fills it (engine thread only)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._executor: Any = None
        # on the host whatever the model's device: llguidance writes it through a pointer
        self._bitmask = torch.empty(0, self.num_words, dtype=torch.int32, device="cpu")

    def apply(self, logits: torch.Tensor, matchers: list[Any]) -> None:
        """Mask `logits` [rows, vocab] in place where `matchers[i]` (None = unconstrained)
        forbids a token. One bitmask fill for the batch, one masking pass over it."""
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        batch = len(matchers)
        if self._bitmask.shape[0] < batch:
            self._bitmask = torch.empty(batch, self.num_words, dtype=torch.int32, device="cpu")
        bitmask = self._bitmask[:batch]
        bitmask.fill_(-1)
        self._executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), self.num_words * 4, batch)
        # set bits = allowed; invert the packed words (tiny) so that unpacking yields the
        # forbidden mask directly, then one numpy putmask over the logits' memory: measured
        # faster here than torch's masked_fill_/where with a bool mask (both are one pass)
        words = np.bitwise_not(bitmask.numpy())
        forbidden = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little").view(np.bool_)
        width = logits.shape[1]
        on_cpu = logits.device.type == "cpu"
        if width <= forbidden.shape[1] and logits.is_contiguous() and on_cpu:
            np.putmask(logits.numpy(), forbidden[:, :width], -np.inf)
            return
        mask = torch.as_tensor(forbidden, device=logits.device)  # one host-to-device copy
        if width <= mask.shape[1]:
            logits.masked_fill_(mask[:, :width], float("-inf"))
        else:  # logits wider than the grammar's vocabulary: the extra ids are never valid
            logits[:, : mask.shape[1]].masked_fill_(mask, float("-inf"))
            logits[[i for _, i in rows], mask.shape[1] :] = float("-inf")
