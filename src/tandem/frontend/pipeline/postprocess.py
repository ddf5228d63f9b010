"""Engine outputs → client text, per choice: incremental detokenization, stop strings matched
across token boundaries (text past a stop string is never emitted), finish reasons, logprobs."""

from __future__ import annotations

from typing import Any

from tandem.errors import EngineError
from tandem.protocols.engine import EngineOutput
from tandem.tokens.detokenizer import make_detokenizer
from tandem.tokens.tokenizer import ModelTokenizer


class StopStringMatcher:
    """Holds back the last `max(len(stop)) - 1` characters, since a stop string may start
    there and finish in text not yet seen. Not thread-safe; one per choice."""

    __slots__ = ("_buf", "_hold", "_include", "_stops", "matched")

    def __init__(self, stops: list[str], *, include_in_output: bool = False) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._include = include_in_output
        self._buf = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Text safe to emit now; after a match (`matched` set) everything is dropped."""
        if self.matched is not None or not text:
            return ""
        buf = self._buf + text
        best, hit = -1, None
        for stop in self._stops:
            pos = buf.find(stop)
            if pos != -1 and (best == -1 or pos < best):
                best, hit = pos, stop
        if hit is not None:
            self.matched, self._buf = hit, ""
            return buf[: best + len(hit)] if self._include else buf[:best]
        cut = max(len(buf) - self._hold, 0)
        self._buf = buf[cut:]
        return buf[:cut]

    def flush(self) -> str:
        """The held-back tail at the end of the stream (cannot contain a whole stop)."""
        out, self._buf = self._buf, ""
        return out if self.matched is None else ""


_FINISH = {"stop": "stop", "length": "length", "cancelled": "abort"}


class ChoiceState:
    """One choice's progress. `process()` updates it and sets the `delta_*` fields that
    describe what this chunk adds; the caller reads them before the next call."""

    __slots__ = (
        "_detok",
        "_hidden",
        "_matcher",
        "_tok",
        "all_logprobs",
        "delta_logprobs",
        "delta_text",
        "finish_reason",
        "index",
        "num_cached_tokens",
        "num_tokens",
        "prefix",
        "sum_logprob",
        "text_parts",
    )

    def __init__(
        self,
        index: int,
        tokenizer: ModelTokenizer | None,
        stops: list[str],
        *,
        include_stop_str: bool = False,
        skip_special_tokens: bool = True,
        hidden_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.index = index
        self._tok = tokenizer
        # ids counted but never written as text (the EOS where special tokens are kept for a
        # tool-call parser)
        self._hidden = hidden_token_ids
        self._detok = (
            make_detokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
            if tokenizer is not None
            else None
        )
        self._matcher = (
            StopStringMatcher(stops, include_in_output=include_stop_str) if stops else None
        )
        self.num_tokens = 0
        self.prefix = ""  # text put in front of the choice's first delta (echo)
        self.sum_logprob = 0.0  # of every token with a logprob (best_of ranks by the mean)
        self.num_cached_tokens: int | None = None
        self.finish_reason: str | None = None
        self.delta_text = ""
        self.delta_logprobs: list[dict[str, Any]] | None = None
        self.text_parts: list[str] = []
        self.all_logprobs: list[dict[str, Any]] | None = None

    def process(self, out: EngineOutput, *, keep_text: bool = False) -> None:
        """Apply one engine chunk. Raises EngineError if the engine reported an error."""
        if out.finish_reason == "error" or out.error is not None:
            raise EngineError(f"engine failed: {out.error or 'unknown error'}")
        if self.num_cached_tokens is None and out.num_cached_tokens is not None:
            self.num_cached_tokens = out.num_cached_tokens
        ids = out.token_ids
        used = len(ids)
        if self._matcher is None:
            text = self._text(ids)
        else:
            text, used = self._through_stops(ids, last=out.finish_reason is not None)
        self.num_tokens += used
        if self.finish_reason is None and out.finish_reason is not None:
            self.finish_reason = _FINISH.get(out.finish_reason, out.finish_reason)
        if self.prefix:
            text, self.prefix = self.prefix + text, ""
        self.delta_text = text
        self.delta_logprobs = self._logprobs(out, used) if out.logprobs is not None else None
        if out.logprobs is not None:
            self.sum_logprob += sum(out.logprobs[:used])
        if keep_text:
            if text:
                self.text_parts.append(text)
            if self.delta_logprobs is not None:
                self.all_logprobs = (self.all_logprobs or []) + self.delta_logprobs

    def _text(self, ids: list[int]) -> str:
        if self._hidden and ids:
            ids = [t for t in ids if t not in self._hidden]
        return self._detok.add(ids) if self._detok is not None and ids else ""

    def _through_stops(self, ids: list[int], *, last: bool) -> tuple[str, int]:
        """The text of `ids` that the stop strings let out, and how many of `ids` count. A
        chunk of several tokens (a verified draft, a coalesced batch) is fed one token at a
        time: the tokens after the one that completes a stop string are neither written nor
        counted in usage, as if the engine had stopped there."""
        matcher = self._matcher
        assert matcher is not None
        if matcher.matched is not None:  # a chunk the engine sent before it saw the stop
            return "", 0
        used = len(ids)
        if used <= 1 or self._detok is None:
            text = matcher.feed(self._text(ids))
        else:
            parts = []
            for token_id in ids:
                parts.append(matcher.feed(self._text([token_id])))
                if matcher.matched is not None:
                    break
            used, text = len(parts), "".join(parts)
        if matcher.matched is not None:
            self.finish_reason = "stop"
        elif last:
            text += matcher.flush()
        return text, used

    def _logprobs(self, out: EngineOutput, used: int) -> list[dict[str, Any]]:
        """Chat-style entries: [{token, logprob, bytes, top_logprobs: [{token, logprob}]}]
        for the first `used` tokens of `out`."""
        entries = []
        tops = out.top_logprobs or [[] for _ in out.token_ids]
        assert out.logprobs is not None
        for tid, lp, top in zip(out.token_ids[:used], out.logprobs, tops, strict=False):
            token = self.token_str(tid)
            entries.append(
                {
                    "token": token,
                    "logprob": lp,
                    "bytes": list(token.encode()),
                    "top_logprobs": [
                        {"token": self.token_str(t.token_id), "logprob": t.logprob} for t in top
                    ],
                }
            )
        return entries

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the choice, if one did (Anthropic's `stop_sequence`)."""
        return self._matcher.matched if self._matcher is not None else None

    def token_str(self, token_id: int) -> str:
        if self._tok is None:
            return f"token_id:{token_id}"
        return self._tok.decode([token_id], skip_special_tokens=False)


# (state, delta_text, delta_logprobs, finish_reason, state.num_tokens) of one processed engine
# chunk; the frontend hands them on in batches: every chunk that had already arrived
Event = tuple[ChoiceState, str, Any, str | None, int]


def best_candidates(
    states: list[ChoiceState], best_of: int, n: int, *, keep_logprobs: bool
) -> list[ChoiceState]:
    """best_of (OpenAI): of each prompt's `best_of` candidates (states p*best_of ..), the `n`
    with the highest mean logprob per token, best first, renumbered as choices p*n ..; their
    logprobs dropped unless the client asked for them."""
    chosen: list[ChoiceState] = []
    for p in range(len(states) // best_of):
        group = states[p * best_of : (p + 1) * best_of]
        group.sort(key=lambda s: s.sum_logprob / max(s.num_tokens, 1), reverse=True)
        for j, state in enumerate(group[:n]):
            state.index = p * n + j
            if not keep_logprobs:
                state.all_logprobs = None
            chosen.append(state)
    return chosen
