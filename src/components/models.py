"""Models: plain `nn.Module`s whose constructors take the shapes they need as keyword arguments.

`conf/model/<name>.yaml` names the class in `_target_`, sets the options, and takes the shapes from
the dataset and task as `${data:FIELD}` (src/config/data_fields.py), e.g. `num_outputs: ${data:num_outputs}`.
A model's `forward` takes the batch parts the task names as inputs: one image batch for the
classifiers here, `(rgb, mask)` for `TwoInputCNN`. Adding a model is one class here (or anywhere
importable) plus one YAML file.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


class SimpleCNN(nn.Module):
    """Two 3x3 conv + BatchNorm blocks, a 2x2 max-pool and a two-layer classifier.

    The classic MNIST-example shape with BatchNorm, so sync-BN matters under DDP.
    """

    def __init__(
        self,
        in_channels: int,
        image_size: Sequence[int],
        num_outputs: int,
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
            nn.Linear(hidden, num_outputs),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class MLP(nn.Module):
    """A multi-layer perceptron on feature vectors, or on images flattened to vectors."""

    def __init__(
        self,
        in_features: int,
        num_outputs: int,
        hidden_sizes: Sequence[int] = (256, 256),
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        width = in_features
        layers: list[nn.Module] = [nn.Flatten()]
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, num_outputs))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def resnet18(in_channels: int, num_outputs: int, small_images: bool = True) -> nn.Module:
    """torchvision's ResNet-18, randomly initialised.

    With `small_images` (for 8x8 to 64x64 inputs) the 7x7 stride-2 stem and its max-pool,
    made for 224x224 ImageNet crops, become one 3x3 stride-1 conv, as is usual for CIFAR:
    otherwise a 32x32 image is 1x1 after the first stage.
    """
    from torchvision.models import resnet18 as torchvision_resnet18

    # Global average pooling makes the network size-agnostic: it needs no image size.
    model = torchvision_resnet18(weights=None, num_classes=num_outputs)
    if small_images:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


class TwoInputCNN(nn.Module):
    """`model(rgb, mask)`: conv + BatchNorm features of the image, averaged over the mask's pixels
    (masked average pooling), then a linear head. The mask chooses where the network looks, so the
    output depends on both inputs; BatchNorm makes sync-BN matter under DDP."""

    def __init__(self, in_channels: int, num_outputs: int, channels: Sequence[int] = (16, 32)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_channels
        for out in channels:
            layers += [nn.Conv2d(width, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
            width = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_outputs)

    def forward(self, rgb: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        weights = mask / mask.sum(dim=(2, 3), keepdim=True).clamp(min=1e-6)  # each mask's pixels sum to 1
        pooled = (self.features(rgb) * weights).sum(dim=(2, 3))
        return self.head(pooled)
