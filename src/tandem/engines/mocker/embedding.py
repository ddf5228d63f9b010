"""The mocker's embeddings: deterministic unit vectors seeded by a hash of the token ids.

Same token ids → the same vector in every process and run (scale and routing tests compare
them across workers); different ids → independent random directions. The components are
i.i.d. Gaussian before normalising, so any prefix of a vector, renormalised, is again such a
vector: the mocker declares itself Matryoshka-capable, and `dimensions` is served by it.
"""

from __future__ import annotations

import numpy as np
import xxhash

SEED = 1337


def hashed_embedding(token_ids: list[int], dim: int) -> np.ndarray:
    """A [dim] float32 unit vector: Gaussian draws seeded by XXH3-64 of the ids (LE u32)."""
    seed = xxhash.xxh3_64_intdigest(np.asarray(token_ids, dtype="<u4").tobytes(), seed=SEED)
    vector = np.random.default_rng(seed).standard_normal(dim)
    return (vector / np.linalg.norm(vector)).astype(np.float32)
