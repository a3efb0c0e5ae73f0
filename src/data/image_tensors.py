"""Image datasets small enough to live on the training device as uint8 tensors: a batch is one index_select,
normalised, augmented and resized on the device, each sample's crop and flip drawn from (seed, epoch, its index)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from src.data.sample_randomness import draw


class ImageTensorDataset(TensorDataset):
    """uint8 images (N, C, H, W) and int64 labels; indexing gives `(normalised float32 image, label)`, resized to
    `size` (H, W) where given (bilinear, antialiased, as torchvision's Resize of a tensor)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean: Sequence[float], std: Sequence[float],
                 crop_padding: int = 0, flip: bool = False, size: Sequence[int] | None = None) -> None:
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"images must be uint8 N x C x H x W, got {images.dtype} {tuple(images.shape)}")
        super().__init__(images, labels)
        channels = images.shape[1]
        self.mean = torch.as_tensor(mean, dtype=torch.float32, device=images.device).view(1, channels, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32, device=images.device).view(1, channels, 1, 1)
        self.crop_padding, self.flip, self.augments = crop_padding, flip, crop_padding > 0 or flip
        self.size = None if size is None or tuple(size) == tuple(images.shape[-2:]) else tuple(int(x) for x in size)

    def to(self, device: torch.device) -> ImageTensorDataset:
        images, labels = (t.to(device) for t in self.tensors)
        return ImageTensorDataset(images, labels, self.mean.flatten(), self.std.flatten(), self.crop_padding, self.flip,
                                  self.size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = self.tensors
        return self.resize(self.normalize(images[index][None]))[0], labels[index]

    def resize(self, images: torch.Tensor) -> torch.Tensor:
        """A normalised (and augmented) batch at `size`."""
        return images if self.size is None else F.interpolate(images, size=self.size, mode="bilinear",
                                                               align_corners=False, antialias=True)

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 batch -> (x / 255 - mean) / std per channel: torchvision's ToTensor and Normalize, to the bit."""
        return images.float().div_(255).sub_(self.mean).div_(self.std)

    def augment(self, images: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """torchvision's RandomCrop(size, crop_padding) and, if `flip`, RandomHorizontalFlip, of each normalised
        image, image j's drawn from `keys[j]` (its `sample_key`, on the images' device)."""
        if not self.augments:
            return images
        n, c, h, w = images.shape
        pad, black = self.crop_padding, -self.mean / self.std
        padded = black.expand(n, c, h + 2 * pad, w + 2 * pad).clone(memory_format=torch.contiguous_format)
        padded[:, :, pad : pad + h, pad : pad + w] = images
        keys = keys.view(n, 1)
        # 2^32 mod (2p + 1) / 2^32: a bias below 1e-9 towards the first offsets, for any padding used.
        top, left = draw(keys, 0) % (2 * pad + 1), draw(keys, 1) % (2 * pad + 1)
        rows = top + torch.arange(h, device=images.device)  # (n, h): the padded rows each crop keeps
        cols = torch.arange(w, device=images.device).expand(n, w)
        if self.flip:
            cols = torch.where((draw(keys, 2) & 1).bool(), cols.flip(1), cols)  # flipped where draw 2 is odd
        cols = left + cols
        # One gather does crop and flip: each output pixel names its padded source pixel.
        source = (rows[:, :, None] * (w + 2 * pad) + cols[:, None, :]).view(n, 1, h * w).expand(n, c, h * w)
        return padded.view(n, c, -1).gather(2, source).view(n, c, h, w)
