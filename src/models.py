"""Models. Each takes the dataset's shape as keyword arguments, so one class works on
any dataset:

    Model(in_channels: int, image_size: tuple[int, int], num_classes: int, **options)

`conf/model/<name>.yaml` names the class in `_target_` and sets the options; the shape
arguments are filled in at run time from the dataset. Adding a model is one class here
(or anywhere importable) plus one YAML file.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from hydra.utils import instantiate
from torch import nn

from src.datasets import DataSplits


def build_model(model_cfg: Any, splits: DataSplits) -> nn.Module:
    """The model `model_cfg` names (`_target_` and options), built for the dataset's shape."""
    return instantiate(
        model_cfg, in_channels=splits.in_channels, image_size=splits.image_size, num_classes=splits.num_classes
    )


class SimpleCNN(nn.Module):
    """Two 3x3 conv + BatchNorm blocks, a 2x2 max-pool and a two-layer classifier.

    The classic MNIST-example shape with BatchNorm, so sync-BN matters under DDP.
    """

    def __init__(
        self,
        in_channels: int,
        image_size: Sequence[int],
        num_classes: int,
        channels: Sequence[int] = (32, 64),
        hidden: int = 128,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        c1, c2 = channels
        height, width = image_size
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, c1, 3, padding=1, bias=False),
            nn.BatchNorm2d(c1),
            nn.ReLU(inplace=True),
            nn.Conv2d(c1, c2, 3, padding=1, bias=False),
            nn.BatchNorm2d(c2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(c2 * (height // 2) * (width // 2), hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class MLP(nn.Module):
    """A multi-layer perceptron on the flattened image."""

    def __init__(
        self,
        in_channels: int,
        image_size: Sequence[int],
        num_classes: int,
        hidden_sizes: Sequence[int] = (256, 256),
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        width = in_channels * image_size[0] * image_size[1]
        layers: list[nn.Module] = [nn.Flatten()]
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def resnet18(in_channels: int, image_size: Sequence[int], num_classes: int, small_images: bool = True) -> nn.Module:
    """torchvision's ResNet-18, randomly initialised.

    With `small_images` (for 8x8 to 64x64 inputs) the 7x7 stride-2 stem and its max-pool,
    made for 224x224 ImageNet crops, become one 3x3 stride-1 conv, as is usual for CIFAR:
    otherwise a 32x32 image is 1x1 after the first stage.
    """
    from torchvision.models import resnet18 as torchvision_resnet18

    del image_size  # global average pooling makes the network size-agnostic
    model = torchvision_resnet18(weights=None, num_classes=num_classes)
    if small_images:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model
