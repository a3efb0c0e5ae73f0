"""Models take their shape from the dataset."""

import pytest
import torch

from src.models import MLP, SimpleCNN, resnet18


@pytest.mark.parametrize("channels,size", [(1, (8, 8)), (1, (28, 28)), (3, (32, 32))])
@pytest.mark.parametrize("build", [SimpleCNN, MLP, resnet18])
def test_models_fit_any_dataset_shape(build, channels, size):
    model = build(in_channels=channels, image_size=size, num_classes=7)
    out = model(torch.randn(4, channels, *size))
    assert out.shape == (4, 7)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_cnn_has_batchnorm_and_the_classic_shape():
    model = SimpleCNN(in_channels=1, image_size=(8, 8), num_classes=10)
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) == 2
    assert model.classifier[2].in_features == 64 * 4 * 4
    assert sum(p.numel() for p in model.parameters()) == 288 + 18432 + 2 * 96 + 1024 * 128 + 128 + 1290


def test_resnet18_small_image_stem():
    model = resnet18(in_channels=1, image_size=(32, 32), num_classes=10)
    assert model.conv1.stride == (1, 1) and model.conv1.in_channels == 1
    assert isinstance(model.maxpool, torch.nn.Identity)
    large = resnet18(in_channels=1, image_size=(224, 224), num_classes=10, small_images=False)
    assert large.conv1.stride == (2, 2) and large.conv1.in_channels == 1
