"""llama.cpp on the same GGUF for `tandem bench engine --llamacpp`, through llama-cpp-python's
low-level API (one context, `n_seq_max` sequences): prefill of one prompt, and decode of n
sequences at once, one token of each in one `llama_batch` a step (what the native engine's
batched decode step does), greedy. The high-level `Llama` class decodes one sequence, so
without this there was no batch-32 comparison.

llama-cpp-python is an optional dependency of the bench only (`pip install llama-cpp-python`:
it builds llama.cpp from source, ~8 min on 2 cores); a missing one is a clear error.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np

INSTALL_HINT = (
    "--llamacpp needs llama-cpp-python (pip install llama-cpp-python; it builds llama.cpp "
    "from source in ~8 min)"
)


def _module() -> Any:
    try:
        import llama_cpp
    except ImportError as exc:
        raise SystemExit(INSTALL_HINT) from exc
    return llama_cpp


class LlamaCppRunner:
    """One llama.cpp model and context for up to `max_seqs` sequences of `seq_len` tokens
    each. Not thread-safe; `close()` frees the context and the model."""

    def __init__(self, path: str, threads: int, max_seqs: int, seq_len: int) -> None:
        self.lib = lib = _module()
        # llama.cpp logs every tensor and graph input at load: drop its log (kept referenced)
        self._quiet = lib.llama_log_callback(lambda level, text, user_data: None)
        lib.llama_log_set(self._quiet, None)
        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        self.model = lib.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = max_seqs * seq_len
        cparams.n_batch = cparams.n_ubatch = max(seq_len, max_seqs)
        cparams.n_seq_max = max_seqs
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise SystemExit(f"llama.cpp could not make a context of {max_seqs} x {seq_len}")
        self.vocab_size = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model)))
        self.max_seqs, self.batch_size = max_seqs, int(cparams.n_batch)
        self.batch = lib.llama_batch_init(self.batch_size, 0, 1)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def clear(self) -> None:
        """Forget every sequence (the KV cache's contents)."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants_logits) items."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(items)
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for a batch of {len(items)} tokens")

    def argmax(self, i: int) -> int:
        """The greedy token of output row i of the last decode."""
        logits = self.lib.llama_get_logits_ith(self.ctx, i)
        ptr = ctypes.cast(logits, ctypes.POINTER(ctypes.c_float))
        return int(np.ctypeslib.as_array(ptr, (self.vocab_size,)).argmax())

    def prefill(self, prompt: list[int], seq: int = 0) -> int:
        """Prefill `prompt` as sequence `seq` in chunks of the batch size; its next token."""
        chunk: list[int] = []
        for start in range(0, len(prompt), self.batch_size):
            chunk = prompt[start : start + self.batch_size]
            last = start + len(chunk) == len(prompt)
            self.decode(
                [(t, start + j, seq, last and j == len(chunk) - 1) for j, t in enumerate(chunk)]
            )
        return self.argmax(len(chunk) - 1)

    def decode_steps(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        """Prefill each prompt as its own sequence, then `new_tokens` batched greedy steps
        (one token of every sequence per llama_decode); (start, end) perf_counter times of
        the decode steps alone."""
        if len(prompts) > self.max_seqs:
            raise ValueError(f"{len(prompts)} sequences; this context holds {self.max_seqs}")
        self.clear()
        tokens = [self.prefill(p, seq) for seq, p in enumerate(prompts)]
        pos = [len(p) for p in prompts]
        start = time.perf_counter()
        for _ in range(new_tokens):
            self.decode([(t, pos[s], s, True) for s, t in enumerate(tokens)])
            tokens = [self.argmax(s) for s in range(len(prompts))]
            pos = [p + 1 for p in pos]
        return start, time.perf_counter()
