"""GPT-2's byte-level alphabet: every byte is spelled as one printable unicode character.

Byte-level BPE vocabularies (GPT-2, SmolLM2, Llama 3, Qwen) spell tokens in this alphabet;
mapping a token back to its raw bytes is a table lookup per character.
"""

from __future__ import annotations


def _byte_to_char() -> dict[int, str]:
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_CHAR: dict[int, str] = _byte_to_char()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_CHAR.items()}


def token_bytes(spelled: str) -> bytes | None:
    """Raw bytes of a byte-level-spelled token, or None if it uses characters outside the
    alphabet (an added token such as `<|im_end|>` spelled in plain text is also in-alphabet)."""
    try:
        return bytes(CHAR_TO_BYTE[c] for c in spelled)
    except KeyError:
        return None
