"""Image grids for TensorBoard, drawn as torchvision's make_grid draws them, without importing torchvision."""

from __future__ import annotations

import torch


def image_grid(images: torch.Tensor, min_side: int = 32) -> torch.Tensor:
    """A (3, H, W) grid in [0, 1] of `images`, eight to a row, each min-max scaled and enlarged to `min_side`."""
    factor = -(-min_side // min(images.shape[-2:]))
    images = images.float().repeat_interleave(factor, dim=-2).repeat_interleave(factor, dim=-1)
    low, high = images.amin(dim=(1, 2, 3), keepdim=True), images.amax(dim=(1, 2, 3), keepdim=True)
    return tile((images - low) / (high - low).clamp(min=1e-5), columns=8, padding=2, pad_value=1.0)


def tile(images: torch.Tensor, columns: int, padding: int, pad_value: float) -> torch.Tensor:
    """(N, C, H, W) images, C = 1 or 3, as one RGB grid of `columns` per row: torchvision's make_grid."""
    count, _, height, width = images.shape
    columns = min(columns, count)
    rows = -(-count // columns)
    grid = images.new_full((3, rows * (height + padding) + padding, columns * (width + padding) + padding), pad_value)
    for index, image in enumerate(images):
        row, column = divmod(index, columns)
        top, left = padding + row * (height + padding), padding + column * (width + padding)
        grid[:, top : top + height, left : left + width] = image  # a grey image broadcasts to RGB
    return grid
