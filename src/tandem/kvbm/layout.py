"""Between an engine's per-layer KV tensors and the flat bytes a tier stores.

A block's KV is exported by the engine as one tensor per layer (any dtype, any device); kvbm
stores the concatenation of their raw bytes, and `split_like` turns the bytes back into tensors
shaped like a template. torch is imported only when tensors are passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

if TYPE_CHECKING:
    import torch

Buffer = bytes | bytearray | memoryview | np.ndarray
# one block's KV as an engine hands it over: bytes, an array, a tensor, or per-layer parts
BlockData: TypeAlias = (
    "Buffer | torch.Tensor | list[Buffer | torch.Tensor] | tuple[Buffer | torch.Tensor, ...]"
)


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    import torch

    host = tensor.detach().to("cpu").contiguous()  # device → host copy happens here
    flat: Any = host.reshape(-1).view(torch.uint8).numpy()
    return memoryview(flat)


def as_bytes(data: BlockData) -> memoryview:
    """A flat uint8 view of `data`: bytes, a bytearray or memoryview, a numpy array, a torch
    tensor, or a list/tuple of those (per-layer parts, concatenated in order). Copies only
    when needed."""
    if isinstance(data, bytes | bytearray | memoryview):
        return memoryview(data).cast("B")
    if isinstance(data, np.ndarray):
        flat: Any = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        return memoryview(flat)
    if isinstance(data, list | tuple):
        return memoryview(b"".join(as_bytes(part) for part in data))
    return _tensor_bytes(data)


def split_like(data: bytes | memoryview, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """CPU tensors with the shapes and dtypes of `like`, filled from `data` in order.
    Raises ValueError when the sizes disagree."""
    import torch

    sizes = [t.numel() * t.element_size() for t in like]
    if sum(sizes) != len(data):
        raise ValueError(f"block of {len(data)} bytes; expected {sum(sizes)} for {len(like)} parts")
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out, start = [], 0
    for template, size in zip(like, sizes, strict=True):
        part = flat[start : start + size].view(template.dtype).reshape(template.shape)
        out.append(part)
        start += size
    return out


def per_block(layers: Sequence[torch.Tensor], *, block_dim: int = 1) -> list[list[torch.Tensor]]:
    """Split per-layer tensors holding n blocks along `block_dim` (as the native engine's
    `export_blocks` returns them, [2, n, ...]) into n per-layer lists of one block each."""
    num_blocks = layers[0].shape[block_dim]
    return [[layer.narrow(block_dim, i, 1) for layer in layers] for i in range(num_blocks)]


def join_blocks(
    blocks: Sequence[bytes | memoryview], like: Sequence[torch.Tensor], *, block_dim: int = 1
) -> list[torch.Tensor]:
    """Per-layer tensors holding all `blocks` along `block_dim`, each block's bytes split like
    the one-block template `like` (e.g. `export_blocks([b])`); the inverse of `per_block`."""
    import torch

    parts = [split_like(data, like) for data in blocks]
    return [torch.cat([p[i] for p in parts], dim=block_dim) for i in range(len(like))]
