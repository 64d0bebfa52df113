"""Small models the harness trains: an MLP, LeNet and a BatchNorm ResNet.

They are deliberately tiny so that a few SGD steps over several CPU processes finish in
seconds, yet they cover the layer kinds whose checkpoints differ in interesting ways:
plain ``Linear`` weights (MLP), convolutions (LeNet), and BatchNorm buffers, including the
integer ``num_batches_tracked`` (ResNet).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

from ckpt_tools.errors import UsageError
from ckpt_tools.harness.config import MODEL_NAMES, check_model_name

__all__ = [
    "MLP",
    "MODEL_NAMES",
    "BasicBlock",
    "LeNet",
    "SmallResNet",
    "build_harness_model",
    "has_batchnorm",
]

#: Input shape every model takes (Fashion-MNIST: one channel, 28 x 28).
IMAGE_SHAPE = (1, 28, 28)
NUM_CLASSES = 10


class MLP(nn.Module):
    """A multilayer perceptron over flattened 1x28x28 images.

    Args:
        hidden: widths of the hidden layers; ``(8,)`` gives a checkpoint of about 25 KB.
        num_classes: number of output logits.
    """

    def __init__(self, hidden: Sequence[int] = (64, 32), num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        widths = [IMAGE_SHAPE[0] * IMAGE_SHAPE[1] * IMAGE_SHAPE[2], *hidden]
        layers: list[nn.Module] = [nn.Flatten()]
        for width_in, width_out in itertools.pairwise(widths):
            layers += [nn.Linear(width_in, width_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class LeNet(nn.Module):
    """LeNet as the "multi-GPU training from scratch" tutorials build it for Fashion-MNIST.

    conv 3x3 (20) -> ReLU -> avgpool 2 -> conv 5x5 (50) -> ReLU -> avgpool 2 -> dense 128 ->
    ReLU -> dense 10 (Dive into Deep Learning, section 13.5), about 129k parameters.

    Args:
        num_classes: number of output logits.
    """

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 20, kernel_size=3),  # 28 -> 26
            nn.ReLU(),
            nn.AvgPool2d(2),  # 26 -> 13
            nn.Conv2d(20, 50, kernel_size=5),  # 13 -> 9
            nn.ReLU(),
            nn.AvgPool2d(2),  # 9 -> 4
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(50 * 4 * 4, 128),
            nn.ReLU(),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class BasicBlock(nn.Module):
    """The ResNet basic block: two 3x3 conv + BatchNorm, with a projection when shapes change.

    Args:
        in_channels: channels coming in.
        out_channels: channels going out.
        stride: stride of the first convolution (2 halves the resolution).
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        # bias=False because the BatchNorm right after has its own shift.
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class SmallResNet(nn.Module):
    """A two-block ResNet with BatchNorm for 1x28x28 input.

    Args:
        channels: widths of the stem/first block and of the second (strided) block.
        num_classes: number of output logits.
    """

    def __init__(self, channels: Sequence[int] = (8, 16), num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        first, second = channels
        self.stem = nn.Sequential(
            nn.Conv2d(IMAGE_SHAPE[0], first, 3, padding=1, bias=False),
            nn.BatchNorm2d(first),
            nn.ReLU(),
        )
        self.layer1 = BasicBlock(first, first)
        self.layer2 = BasicBlock(first, second, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(second, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(self.pool(x).flatten(1))


# The classes behind MODEL_NAMES (config.py, torch-free); "resnet-syncbn" is the ResNet
# converted to SyncBatchNorm by build_harness_model.
_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "mlp": MLP,
    "lenet": LeNet,
    "resnet": SmallResNet,
}


def build_harness_model(name: str, *, sync_bn: bool = False, **kw: Any) -> nn.Module:
    """Build one of the harness models with freshly initialised weights.

    Weights come from the global torch RNG, so seed it (or use
    :func:`ckpt_tools.harness.loop.init_model`) for reproducible weights.

    Args:
        name: one of :data:`MODEL_NAMES`: ``"mlp"``, ``"lenet"``, ``"resnet"``, or
            ``"resnet-syncbn"`` (the ResNet with every BatchNorm turned into
            :class:`torch.nn.SyncBatchNorm`).
        sync_bn: convert BatchNorm layers to SyncBatchNorm (what DDP on GPUs needs for
            batch statistics over the global batch). The state-dict keys do not change.
        **kw: passed to the model class (e.g. ``hidden=(8,)`` for the MLP).

    Returns:
        The model, in training mode, on the CPU.

    Raises:
        UsageError: ``name`` is not a known model, or ``kw`` does not fit it.

    Example:
        >>> model = build_harness_model("mlp", hidden=(8,))
        >>> sorted(model.state_dict())[:2]
        ['net.1.bias', 'net.1.weight']
    """
    key = check_model_name(name, argument="name")
    if key == "resnet-syncbn":
        key, sync_bn = "resnet", True
    try:
        model = _BUILDERS[key](**kw)
    except TypeError as exc:
        raise UsageError(f"model {name!r} does not take these arguments: {kw!r} ({exc})") from exc
    if sync_bn:
        # SyncBatchNorm keeps BatchNorm's parameters and buffers under the same names,
        # so checkpoints stay interchangeable with the plain model.
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def has_batchnorm(model: nn.Module) -> bool:
    """Tell whether ``model`` has any BatchNorm (or SyncBatchNorm) layer.

    Args:
        model: any module.

    Returns:
        True when some submodule normalises with batch statistics.

    Example:
        >>> has_batchnorm(build_harness_model("resnet")), has_batchnorm(build_harness_model("mlp"))
        (True, False)
    """
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
