"""`DraftOdds`: a decoding sequence's recent prompt-lookup draft outcomes, from which the
speculator (speculation.py) chooses how long its next draft is. Kept on the `Sequence`."""

from __future__ import annotations

from dataclasses import dataclass

FORGET = 7 / 8  # each draft's outcome weighs 7/8 of the next one's: odds follow ~8 drafts


@dataclass(slots=True)
class DraftOdds:
    """One sequence's recent draft outcomes, each count decayed by FORGET a draft, over a
    uniform prior (one held and one failed): how often a draft's first token holds, and how
    often a token holds once the one before it did. Two rates, not one: drafts hold in runs
    (the answer copies a span, then writes its own words), so a single per-token rate would
    draft a copied span short and free text long."""

    first_held: float = 0.0
    first_tried: float = 0.0
    next_held: float = 0.0
    next_tried: float = 0.0
    idle: int = 0  # decode steps since this sequence last drafted by choice of length

    def rates(self) -> tuple[float, float]:
        """(p_first, p_next); 1/2 each before any evidence. A pooled prior (every sequence's
        drafts) measured no different on the bench's workloads, so each sequence starts
        from nothing."""
        return (
            (self.first_held + 1.0) / (self.first_tried + 2.0),
            (self.next_held + 1.0) / (self.next_tried + 2.0),
        )

    def add(self, drafted: int, accepted: int) -> None:
        """A verified draft of `drafted` tokens of which the first `accepted` held."""
        self.first_held = FORGET * self.first_held + (accepted > 0)
        self.first_tried = FORGET * self.first_tried + 1.0
        # tokens 2.. were tried while the one before held: up to the first rejected one
        self.next_held = FORGET * self.next_held + max(accepted - 1, 0)
        self.next_tried = FORGET * self.next_tried + max(min(accepted + 1, drafted) - 1, 0)


def expected_tokens(rates: tuple[float, float], length: int) -> list[float]:
    """Expected tokens a step emits with a draft of 0..length tokens (1 with none), at
    (p_first, p_next) `rates`."""
    out, total, (term, q) = [1.0], 1.0, rates
    for _ in range(length):
        total += term
        term *= q
        out.append(total)
    return out
