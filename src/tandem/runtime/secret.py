"""The cluster secret: one shared key that every process of a deployment holds.

It authenticates request-plane and transfer-agent connections (challenge–response at
connection start), event-plane messages (a tag per message; on NATS also their encryption)
and file and etcd discovery records (a tag per record). Each use derives its own key
(`key_for`), so a tag made for one plane never verifies on another. `tandem serve` generates
one per stack; split deployments pass the same value to every process (`--cluster-secret`,
`--cluster-secret-file`, `TANDEM_CLUSTER_SECRET`).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import secrets
import stat
from collections import Counter

MIN_SECRET_CHARS = 32
MIN_DISTINCT_CHARS = 6
MIN_ENTROPY_BITS_PER_CHAR = 2.0
# words of the placeholders that examples and templates ship (all-one-character and other
# low-entropy values are caught by the bounds above)
PLACEHOLDER_WORDS = ("replace", "changeme", "change-me", "change_me", "example", "placeholder",
                     "secret", "password", "passw0rd", "default", "insecure")  # fmt: skip
GENERATE_HINT = "python -c 'import secrets; print(secrets.token_hex(32))'"
NONCE_BYTES = 16


def generate_secret() -> str:
    """A fresh random secret (256 bits, hex)."""
    return secrets.token_hex(32)


def read_secret_file(path: str) -> str:
    """The secret in `path` (surrounding whitespace stripped). Refuses a file that other
    users can read, as ssh does with private keys."""
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as f:
            value = f.read().strip()
    except OSError as exc:
        raise ValueError(f"cluster secret file {path!r} cannot be read: {exc}") from exc
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"cluster secret file {path!r} has mode {stat.S_IMODE(st.st_mode):o}; "
            "expected 600 (readable by its owner only): chmod 600 it"
        )
    return value


def write_secret_file(path: str, value: str) -> None:
    """Write `value` to a new 0600 file (never readable by others, even for an instant)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(value + "\n")


def check_secret(value: str) -> None:
    """Refuse a secret that is short, a known placeholder or of low entropy, naming why.

    The bounds are set so that real random secrets of >= 32 characters always pass: over 10⁶
    random 32-character hex strings (AMD EPYC, numpy) the fewest distinct characters seen was
    8 and the lowest Shannon entropy 2.83 bits per character (base64: 16 and 3.76); the
    chance of a random 32-character hex string with fewer than 6 distinct characters is
    about 2·10⁻¹⁰. Hex never holds a placeholder word (each has a letter past 'f'); a random
    44-character base64 string holds 'secret' about once in 3·10⁷."""
    fix = f"generate one with: openssl rand -hex 32 (or {GENERATE_HINT})"
    if len(value) < MIN_SECRET_CHARS:
        raise ValueError(
            f"cluster secret of {len(value)} characters is too short; expected at least "
            f"{MIN_SECRET_CHARS}: {fix}"
        )
    lowered = value.lower()
    for word in PLACEHOLDER_WORDS:
        if word in lowered:
            raise ValueError(
                f"cluster secret contains {word!r}: it is a placeholder, known to anyone who "
                f"read the example it came from; {fix}"
            )
    distinct = len(set(value))
    if distinct < MIN_DISTINCT_CHARS:
        raise ValueError(
            f"cluster secret has only {distinct} distinct characters (expected at least "
            f"{MIN_DISTINCT_CHARS}): it is guessable, not random; {fix}"
        )
    bits = entropy_bits_per_char(value)
    if bits < MIN_ENTROPY_BITS_PER_CHAR:
        raise ValueError(
            f"cluster secret has {bits:.2f} bits of entropy per character (expected at least "
            f"{MIN_ENTROPY_BITS_PER_CHAR}): it is guessable, not random; {fix}"
        )
    for period in range(1, len(value) // 2 + 1):
        if value == (value[:period] * (len(value) // period + 1))[: len(value)]:
            raise ValueError(
                f"cluster secret repeats a {period}-character pattern: it is guessable, not "
                f"random; {fix}"
            )


def entropy_bits_per_char(value: str) -> float:
    """Shannon entropy of the value's character frequencies, bits per character."""
    n = len(value)
    return -sum(c / n * math.log2(c / n) for c in Counter(value).values()) if n else 0.0


def key_for(secret: str, purpose: str) -> bytes:
    """The key of one use of the secret (`purpose` names the plane and protocol version)."""
    return hmac.new(secret.encode(), b"tandem/" + purpose.encode(), hashlib.sha256).digest()


def tag(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over `parts`, each length-prefixed so that no two splits collide."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(4, "big"))
        mac.update(part)
    return mac.digest()


def is_valid_tag(key: bytes, expected: bytes | None, *parts: bytes) -> bool:
    return isinstance(expected, bytes) and hmac.compare_digest(tag(key, *parts), expected)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def client_proof(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """What a connecting client answers to the server's challenge."""
    return tag(key, b"client", server_nonce, client_nonce)


def server_proof(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """What the server answers to the client's nonce (mutual authentication: a client never
    sends requests to a listener that does not hold the secret)."""
    return tag(key, b"server", server_nonce, client_nonce)
