"""src/reports/images.py: image grids drawn without torchvision, as torchvision draws them."""

import pytest
import torch

from src.reports.images import image_grid, tile


def test_image_grid_scales_each_image_to_its_own_range_and_enlarges_small_ones():
    images = torch.stack([torch.arange(64.0).view(1, 8, 8) * scale - offset
                          for scale, offset in [(1, 0), (0.01, 3), (-5, -1)]])
    grid = image_grid(images)
    tile, pad = 32, 2  # 8 pixels enlarged 4 times; make_grid's default padding
    assert grid.shape == (3, tile + 2 * pad, 3 * (tile + pad) + pad)
    for index in range(3):
        left = pad + index * (tile + pad)
        shown = grid[:, pad:pad + tile, left:left + tile]
        assert shown.min() == 0 and shown.max() == 1  # every image uses the whole range
        assert (shown[0] == shown[1]).all()  # grey: one channel repeated
        assert (shown[:, :4, :4] == shown[:, 0, 0].view(3, 1, 1)).all()  # a pixel became 4x4
    first = grid[0, pad:pad + tile:4, pad:pad + tile:4]
    assert torch.allclose(first, torch.arange(64.0).view(8, 8) / 63)


@pytest.mark.parametrize("count,channels,columns,padding", [(5, 1, 8, 2), (16, 3, 8, 2), (9, 3, 3, 1)])
def test_tile_is_torchvisions_make_grid(count, channels, columns, padding):
    from torchvision.utils import make_grid

    images = torch.rand(count, channels, 6, 7, generator=torch.Generator().manual_seed(count))
    expected = make_grid(images, nrow=columns, padding=padding, pad_value=0.25)
    assert torch.equal(tile(images, columns=columns, padding=padding, pad_value=0.25), expected)
