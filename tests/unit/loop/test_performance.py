"""Backend flags, channels_last and host memory reuse (src/loop/performance.py), on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from src.components.models import SimpleCNN
from src.loop import performance

# ---- backend flags ---------------------------------------------------------------------------


@pytest.mark.parametrize("device, tf32, deterministic, benchmark", [
    ("cuda", True, False, True),
    ("cuda", False, True, False),
    ("cpu", True, False, False),  # cudnn.benchmark only means something for CUDA devices
])
def test_backend_flags(restore_backend_flags, device, tf32, deterministic, benchmark):
    performance.set_backend_flags(torch.device(device), tf32=tf32, deterministic=deterministic)
    assert torch.backends.cuda.matmul.allow_tf32 is tf32 and torch.backends.cudnn.allow_tf32 is tf32
    assert torch.backends.cudnn.deterministic is deterministic
    assert torch.backends.cudnn.benchmark is benchmark


# ---- channels_last ---------------------------------------------------------------------------


def cnn(seed: int = 0) -> SimpleCNN:
    torch.manual_seed(seed)
    return SimpleCNN(in_channels=3, image_size=(8, 8), num_outputs=10)


def test_channels_last_model_takes_weights_and_inputs_in_nhwc():
    model = performance.with_memory_format(cnn(), channels_last=True)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert all(conv.weight.is_contiguous(memory_format=torch.channels_last) for conv in convs)
    assert not all(conv.weight.is_contiguous() for conv in convs)
    seen = []
    convs[0].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    images = torch.randn(4, 3, 8, 8)
    model(images)
    assert images.is_contiguous()  # the caller's batch is left alone
    assert seen[0].is_contiguous(memory_format=torch.channels_last) and not seen[0].is_contiguous()
    torch.testing.assert_close(seen[0], images)


def test_without_channels_last_the_model_is_unchanged():
    model = cnn()
    assert performance.with_memory_format(model, channels_last=False) is model
    assert not model._forward_pre_hooks and model.features[0].weight.is_contiguous()


def train_losses(model: nn.Module, steps: int = 15) -> list[float]:
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(32 * steps, 3, 8, 8, generator=generator)
    labels = torch.randint(0, 10, (32 * steps,), generator=generator)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        batch = slice(32 * step, 32 * (step + 1))
        loss = F.cross_entropy(model(images[batch]), labels[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_channels_last_trains_to_the_same_losses():
    contiguous = train_losses(cnn())
    channels_last = train_losses(performance.with_memory_format(cnn(), channels_last=True))
    assert contiguous[-1] < contiguous[0]  # it does learn
    assert channels_last == pytest.approx(contiguous, rel=1e-4, abs=1e-5)
