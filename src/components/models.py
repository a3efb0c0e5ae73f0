"""Models: plain `nn.Module`s whose constructors take the shapes they need as keyword arguments.

`conf/model/<name>.yaml` names the class in `_target_`, sets the options, and takes the shapes from
the dataset and task as `${data:FIELD}` (src/config/data_fields.py), e.g. `num_outputs: ${data:num_outputs}`.
A model's `forward` takes the sample fields the task binds as inputs (by default every field but the
target, in order): one image batch for the classifiers here, `(rgb, mask)` for `TwoInputCNN`, token ids for
`TinyGPT`. Adding a model is one class here (or anywhere importable) plus one YAML file.

Each model here says how it initialises, `init_module(module, name)`: one module's own tensors, called for every
module that owns some (src/loop/initial_weights.py). That lets it be built on the meta device, and gives it the
same weights under dist=ddp and dist=fsdp on any world size. Most take torch's own layer initialisation
(`LayerDefaults`: their constructors' very weights); a model without the hook is built by its constructor.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class LayerDefaults:
    """`init_module`: each layer as torch's constructor draws it (`reset_parameters()`), in the order the model
    registers them: the weights `torch.manual_seed(seed); Model(...)` gets, built on the meta device or not."""

    def init_module(self, module: nn.Module, name: str) -> None:
        module.reset_parameters()


def check_widths(**widths: int | Sequence[int]) -> None:
    """Refuse a layer narrower than 1: torch builds a zero-width layer with only a warning, and the model's output
    no longer depends on its input (a negative width fails deep in torch instead)."""
    for key, value in widths.items():
        if any(width < 1 for width in ([value] if isinstance(value, int) else value)):
            shown = value if isinstance(value, int) else list(value)
            raise ValueError(f"{key}={shown}: every layer needs a width of at least 1")


class SimpleCNN(LayerDefaults, nn.Module):
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
        check_widths(channels=channels, hidden=hidden)
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


class MLP(LayerDefaults, nn.Module):
    """A multi-layer perceptron on feature vectors, or on images flattened to vectors."""

    def __init__(
        self,
        in_features: int,
        num_outputs: int,
        hidden_sizes: Sequence[int] = (256, 256),
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        check_widths(hidden_sizes=hidden_sizes)
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
    model.init_module = _torchvision_resnet_init  # per module, as train.py initialises (src/loop/initial_weights.py)
    return model


def _torchvision_resnet_init(module: nn.Module, name: str) -> None:
    """torchvision's ResNet initialisation of one module's own tensors: Kaiming-normal (fan-out) convolutions;
    BatchNorm (weight 1, bias 0) and the linear head as torch builds them."""
    if isinstance(module, nn.Conv2d):
        nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


class TwoInputCNN(LayerDefaults, nn.Module):
    """`model(rgb, mask)`: conv + BatchNorm features of the image, averaged over the mask's pixels
    (masked average pooling), then a linear head. The mask chooses where the network looks, so the
    output depends on both inputs; BatchNorm makes sync-BN matter under DDP."""

    def __init__(self, in_channels: int, num_outputs: int, channels: Sequence[int] = (16, 32)) -> None:
        super().__init__()
        check_widths(channels=channels)
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


class LeNet5(LayerDefaults, nn.Module):
    """LeNet-5 for 32x32 images: conv 6 5x5, max-pool 2, conv 16 5x5, max-pool 2, fully connected 120, 84 and
    `num_outputs`, with ReLU (the layout of PyTorch's CIFAR-10 tutorial network; LeCun et al. 1998 used
    tanh-like squashing and subsampling layers with weights)."""

    def __init__(self, in_channels: int, num_outputs: int, image_size: Sequence[int] = (32, 32)) -> None:
        super().__init__()
        height, width = (((side - 4) // 2 - 4) // 2 for side in image_size)  # after the valid 5x5 convs, pools
        if min(height, width) < 1:  # else the second convolution fails in the first forward
            raise ValueError(f"LeNet5 takes images of at least 16x16 (two valid 5x5 convolutions, each pooled by 2), "
                             f"not {'x'.join(map(str, image_size))}: choose a dataset of larger images (mnist)")
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(16 * height * width, 120), nn.ReLU(inplace=True),
            nn.Linear(120, 84), nn.ReLU(inplace=True), nn.Linear(84, num_outputs),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class TinyGPT(nn.Module):
    """A small decoder-only transformer over token ids (N, T) giving next-token logits (N, T, num_outputs):
    token and learned position embeddings, `depth` pre-LayerNorm blocks of causal self-attention and a 4x MLP,
    a final LayerNorm and a linear head (GPT-2's layout, as in nanoGPT). Attention is
    `F.scaled_dot_product_attention(is_causal=True)`: position t sees positions up to t only, so the padding
    at the end of a shorter sequence never changes the logits of its tokens. No BatchNorm: sync-BN is moot."""

    def __init__(self, vocab_size: int, num_outputs: int, max_length: int, width: int = 64, depth: int = 2,
                 heads: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        check_widths(width=width)
        if width % heads:
            raise ValueError(f"TinyGPT: width={width} must be divisible by heads={heads}")
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.position_embedding = nn.Embedding(max_length, width)
        self.blocks = nn.Sequential(*(_CausalBlock(width, heads, dropout) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_outputs)
        self.dropout = nn.Dropout(dropout)

    @staticmethod
    def init_module(module: nn.Module, name: str) -> None:
        """GPT-2's initialisation of one module's own tensors: N(0, 0.02) weights, zero biases; LayerNorm as
        torch builds it. train.py calls it per module, from a seed derived from the module's name
        (src/loop/initial_weights.py)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        return self.head(self.norm(self.blocks(x)))


class _CausalBlock(nn.Module):
    """x + attention(LayerNorm(x)), then x + MLP(LayerNorm(x)); attention causal, over `heads` heads."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout_p = heads, dropout
        self.attention_norm, self.mlp_norm = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.projection = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        qkv = self.qkv(self.attention_norm(x)).view(batch, length, 3, self.heads, width // self.heads)
        query, key, value = qkv.permute(2, 0, 3, 1, 4)  # each (batch, heads, length, head width)
        attended = F.scaled_dot_product_attention(query, key, value, is_causal=True,
                                                  dropout_p=self.dropout_p if self.training else 0.0)
        x = x + self.dropout(self.projection(attended.transpose(1, 2).reshape(batch, length, width)))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))
