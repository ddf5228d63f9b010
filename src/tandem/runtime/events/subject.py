"""NATS-style subject matching: dot-separated tokens, `*` = one token, `>` = one or more
trailing tokens (only as the last token)."""

from __future__ import annotations

from collections.abc import Callable


def validate_pattern(pattern: str) -> list[str]:
    """Split a subscription subject into tokens; raises ValueError when malformed."""
    tokens = pattern.split(".")
    if not pattern or any(not t for t in tokens):
        raise ValueError(
            f"subject {pattern!r} is malformed; expected non-empty dot-separated tokens"
        )
    for i, tok in enumerate(tokens):
        if tok == ">" and i != len(tokens) - 1:
            raise ValueError(f"subject {pattern!r}: '>' is only allowed as the last token")
        if tok not in ("*", ">") and ("*" in tok or ">" in tok):
            raise ValueError(f"subject {pattern!r}: wildcards must be whole tokens")
    return tokens


def validate_subject(subject: str) -> None:
    """A publish subject: non-empty tokens, no wildcards."""
    tokens = subject.split(".")
    if not subject or any(not t or t in ("*", ">") for t in tokens):
        raise ValueError(f"publish subject {subject!r} must be non-empty tokens without wildcards")


def compile_matcher(pattern: str) -> Callable[[str], bool]:
    """Return a predicate `subject -> bool` for `pattern`; literal patterns compare by ==."""
    tokens = validate_pattern(pattern)
    if "*" not in tokens and tokens[-1] != ">":
        return pattern.__eq__
    tail = tokens[-1] == ">"
    head = tokens[:-1] if tail else tokens

    def match(subject: str) -> bool:
        parts = subject.split(".")
        if tail:
            if len(parts) <= len(head):
                return False
        elif len(parts) != len(head):
            return False
        return all(p == "*" or p == s for p, s in zip(head, parts, strict=False))

    return match
