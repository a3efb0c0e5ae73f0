"""image_folder's and arrow's transforms: the options a user sets, and where their draws come from."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from src.components.datasets import image_transforms
from src.data.sample_randomness import host_seed, seed_host_generators


def photo() -> Image.Image:
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 30, 3), dtype=np.uint8))


def drawn(transform, seed: int) -> torch.Tensor:
    seed_host_generators(host_seed(seed, 0, 0))
    return transform(photo())


def test_crop_flip_and_jitter_draw_from_the_seeded_generators():
    train, val = image_transforms((8, 6), 3, augment=True, crop_scale=(0.35, 1.0), color_jitter=0.4)
    first = drawn(train, seed=0)
    assert first.shape == (3, 8, 6)
    assert torch.equal(first, drawn(train, seed=0))
    assert len({drawn(train, seed).sum().item() for seed in range(8)}) == 8
    assert torch.equal(val(photo()), drawn(val, seed=3))  # val draws nothing


def test_without_augmentation_training_sees_the_val_transform():
    train, val = image_transforms((8, 6), 1, augment=False, crop_scale=(0.35, 1.0), color_jitter=0.4)
    assert torch.equal(drawn(train, seed=0), val(photo())) and val(photo()).shape == (1, 8, 6)


def test_without_crop_scale_the_whole_image_is_resized_then_flipped_or_not():
    train, val = image_transforms((8, 6), 3, augment=True, crop_scale=None, color_jitter=0.0)
    resized = val(photo())
    outcomes = {torch.equal(drawn(train, seed), resized) for seed in range(16)}
    assert outcomes == {True, False}
    assert all(torch.equal(drawn(train, seed), resized) or torch.equal(drawn(train, seed), resized.flip(-1))
               for seed in range(16))


def test_channels_other_than_1_or_3_are_refused():
    with pytest.raises(ValueError, match="channels must be 1 .* or 3"):
        image_transforms((8, 8), 2, True, None, 0.0)
