"""Decoded RGB images → the MobileNetV2 input batch (torchvision's ImageNet evaluation transform:
shorter side to 256 with antialiased bilinear resampling, centre crop 224, mean/std normalised)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.nn import functional as F

from tandem.multimodal.encoder.mobilenet import IMAGE_SIZE, IMAGENET_MEAN, IMAGENET_STD

RESIZE_SHORTER = 256
_mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
_std = torch.tensor(IMAGENET_STD).view(3, 1, 1)


def image_tensor(pixels: np.ndarray) -> torch.Tensor:
    """uint8 HxWx3 RGB → float `[3, 224, 224]`, normalised. Raises `ValueError` for another
    layout or an image smaller than 1×1."""
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"pixels must be uint8 HxWx3, got {pixels.dtype} {pixels.shape}")
    height, width = pixels.shape[:2]
    if height < 1 or width < 1:
        raise ValueError(f"image is {width}x{height}; expected at least 1x1")
    # np.array copies: decoded pixels are read-only and torch wants writable memory
    x = torch.from_numpy(np.array(pixels)).permute(2, 0, 1).unsqueeze(0).float().div_(255.0)
    scale = RESIZE_SHORTER / min(height, width)
    size = (max(IMAGE_SIZE, round(height * scale)), max(IMAGE_SIZE, round(width * scale)))
    x = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)[0]
    top, left = (size[0] - IMAGE_SIZE) // 2, (size[1] - IMAGE_SIZE) // 2
    x = x[:, top : top + IMAGE_SIZE, left : left + IMAGE_SIZE]
    return (x - _mean) / _std


def image_batch(images: Sequence[np.ndarray]) -> torch.Tensor:
    """`[B, 3, 224, 224]` for a non-empty sequence of uint8 HxWx3 arrays."""
    if not images:
        raise ValueError("no images to encode")
    return torch.stack([image_tensor(p) for p in images])
