"""Real photos for multimodal tests: scikit-image's data folder (shipped in its wheel), plus
small synthetic images; as bytes and as data: URLs."""

from __future__ import annotations

import base64
import importlib.util
import io
from pathlib import Path

import numpy as np


def skimage_data_dir() -> Path:
    """scikit-image's bundled data folder (located, never imported: importing skimage is slow)."""
    spec = importlib.util.find_spec("skimage")
    assert spec is not None and spec.submodule_search_locations, "scikit-image is not installed"
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def photo_bytes(name: str) -> bytes:
    """e.g. "chelsea.png" (a cat), "coffee.png" (a cup of coffee), "rocket.jpg"."""
    return (skimage_data_dir() / name).read_bytes()


def synthetic_png(width: int = 8, height: int = 6, seed: int = 0, fmt: str = "PNG") -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"
