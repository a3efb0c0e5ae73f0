"""FLOP counting, peak FLOP/s and MFU arithmetic (src/callbacks/utilization.py), on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from one_model import one_model_parts
from torch import nn

from src.callbacks import utilization as utilization_module
from src.callbacks.utilization import GIB, MFU, Utilization, mfu, peak_flops, training_flops_per_sample
from src.components.models import SimpleCNN
from src.components.tasks import Classification
from src.loop import performance
from src.loop.callback import Callbacks, Step
from src.parallel.distributed import DistEnv, Runtime


def cnn(seed: int = 0) -> SimpleCNN:
    torch.manual_seed(seed)
    return SimpleCNN(in_channels=3, image_size=(8, 8), num_outputs=10)


# ---- FLOPs -----------------------------------------------------------------------------------


def test_linear_flops_forward_is_2_in_out_and_backward_twice_that_except_for_the_first_layer():
    from torch.utils.flop_counter import FlopCounterMode

    layer = nn.Linear(20, 30)
    counter = FlopCounterMode(display=False)
    with counter:
        layer(torch.randn(8, 20))
    assert counter.get_total_flops() == 2 * 20 * 30 * 8

    # Training: 3x forward for every layer (weight and input gradients), except the first layer,
    # whose input (the images) needs no gradient: 2x there.
    mlp = nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 5))
    assert training_flops_per_sample(mlp, meta_batch(8, 20), batch_size=8) == 2 * 2 * 20 * 30 + 3 * 2 * 30 * 5


def meta_batch(batch_size: int, *shape: int) -> tuple[tuple[torch.Tensor], dict]:
    """Model inputs (positional, keyword) of one micro-batch of `shape` samples, on the meta device."""
    return (torch.empty(batch_size, *shape, device="meta"),), {}


class TwoInputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(20, 5), torch.nn.Linear(7, 5)

    def forward(self, x: torch.Tensor, *, extra: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(extra)


def test_flops_are_counted_on_the_batch_structure_the_model_takes():
    inputs = ((torch.empty(4, 20, device="meta"),), {"extra": torch.empty(4, 7, device="meta")})
    # Forward 2*in*out per layer; backward adds the weight gradients (another 2*in*out), no input gradients.
    assert training_flops_per_sample(TwoInputs(), inputs, batch_size=4) == 2 * 2 * 20 * 5 + 2 * 2 * 7 * 5


def test_cnn_training_flops_per_sample_match_the_layer_shapes():
    model = SimpleCNN(in_channels=1, image_size=(8, 8), num_outputs=10)
    conv1 = 2 * (1 * 9) * 32 * 64  # 2 x (inputs per output) x outputs, 8x8 positions
    conv2 = 2 * (32 * 9) * 64 * 64
    fc1, fc2 = 2 * 64 * 4 * 4 * 128, 2 * 128 * 10
    expected = 2 * conv1 + 3 * (conv2 + fc1 + fc2)
    assert training_flops_per_sample(model, meta_batch(16, 1, 8, 8), batch_size=16) == expected == 7_945_728


def test_flop_counting_leaves_the_model_untouched():
    model = cnn()
    model.train()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    training_flops_per_sample(model, meta_batch(4, 3, 8, 8), batch_size=4)
    assert model.training
    assert all(p.grad is None and p.device.type == "cpu" for p in model.parameters())
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name  # weights and BatchNorm statistics alike


# ---- peak FLOP/s and MFU ---------------------------------------------------------------------


@pytest.mark.parametrize("name, precision, tf32, tflops", [
    ("NVIDIA A100-SXM4-80GB", "32", True, 156),
    ("NVIDIA A100-SXM4-80GB", "32", False, 19.5),
    ("NVIDIA A100 80GB PCIe", "bf16", True, 312),
    ("NVIDIA H100 80GB HBM3", "bf16", True, 989.4),
    ("NVIDIA H100 PCIe", "16", True, 756.5),
    ("NVIDIA H100 NVL", "32", True, 417.5),
    ("NVIDIA H200", "bf16", True, 989.4),
    ("Tesla V100-SXM2-16GB", "32", True, 15.7),  # no TF32 before Ampere: the flag changes nothing
    ("Tesla V100-PCIE-32GB", "16", True, 112),
    ("Tesla V100S-PCIE-32GB", "16", True, 130),
    ("Tesla V100-SXM2-16GB", "bf16", True, None),  # no bf16 tensor cores
    ("NVIDIA A10", "bf16", True, 125),
    ("NVIDIA A10G", "bf16", True, None),  # not the A10, not the A100
    ("NVIDIA L4", "16", True, 121),
    ("NVIDIA L40S", "32", False, 91.6),
    ("Tesla T4", "16", True, 65),
    ("NVIDIA GeForce RTX 3090", "bf16", True, 71),
    ("NVIDIA GeForce RTX 4090", "32", True, 82.6),
    ("NVIDIA GeForce GTX 1080", "32", True, None),
])
def test_peak_flops_by_gpu_name_and_precision(name, precision, tf32, tflops):
    expected = None if tflops is None else pytest.approx(tflops * 1e12)
    assert peak_flops(name, precision, tf32) == expected


def test_mfu_is_model_flops_rate_over_the_groups_peak():
    assert mfu(flops_per_sample=1e9, samples_per_s=1000, peak_flops_per_device=1e12, world_size=1) == 1.0
    assert mfu(flops_per_sample=1e9, samples_per_s=1000, peak_flops_per_device=1e12, world_size=4) == 0.25
    assert mfu(flops_per_sample=6e6, samples_per_s=5e4, peak_flops_per_device=312e12, world_size=2) == (
        pytest.approx(6e6 * 5e4 / 624e12))


def test_utilization_on_the_cpu_counts_and_reports_nothing(monkeypatch):
    monkeypatch.setattr(utilization_module, "training_flops_per_sample", lambda *args: pytest.fail("counted FLOPs"))
    utilization = Utilization(cnn(), torch.device("cpu"), "32", 1, meta_batch(32, 3, 8, 8), micro_batch_size=32)
    assert utilization.scalars(samples_per_s=1000.0) == {}


def test_utilization_on_an_unknown_gpu_reports_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    utilization = Utilization(cnn(), torch.device("cuda", 0), "bf16", 1, meta_batch(32, 3, 8, 8), micro_batch_size=32)
    assert utilization.scalars(samples_per_s=1000.0) == {}


def test_utilization_on_a_known_gpu_reports_mfu_and_peak_memory(monkeypatch, restore_backend_flags):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * GIB)
    performance.set_backend_flags(torch.device("cuda"), tf32=True, deterministic=False)
    model = SimpleCNN(in_channels=1, image_size=(8, 8), num_outputs=10)
    utilization = Utilization(model, torch.device("cuda", 0), "32", 2, meta_batch(32, 1, 8, 8), micro_batch_size=32)
    scalars = utilization.scalars(samples_per_s=10_000.0)
    assert scalars == {"perf/mfu": pytest.approx(7_945_728 * 10_000 / (156e12 * 2)), "memory/peak_allocated_gib": 3.0}


def test_the_callback_turns_itself_off_on_the_cpu():
    callback = MFU()
    run = SimpleNamespace(parts=SimpleNamespace(runtime=SimpleNamespace(device=torch.device("cpu"))),
                          config=SimpleNamespace(precision=32))
    callbacks = Callbacks({"mfu": callback})
    callbacks.run_start(run)
    assert not callback.enabled and callbacks.log(5, {"throughput/samples_per_s": 1000.0}) == {}


def test_the_callback_reports_the_mfu_of_the_model_the_step_fed_on_a_known_gpu(monkeypatch, restore_backend_flags):
    """Through the hooks, with the run's real TrainParts: the model is the task's output model (by name)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * GIB)
    performance.set_backend_flags(torch.device("cuda"), tf32=True, deterministic=False)
    model = SimpleCNN(in_channels=1, image_size=(8, 8), num_outputs=10)
    runtime = Runtime(DistEnv(world_size=2), torch.device("cuda", 0), backend="nccl")
    data = SimpleNamespace(train_sampler=SimpleNamespace(micro_batch_size=32))
    parts = one_model_parts(runtime, Classification(), model, model, None, None, data, None, None)
    run = SimpleNamespace(parts=parts, config=SimpleNamespace(precision="32"))
    callback = MFU()
    callbacks = Callbacks({"mfu": callback})
    callbacks.run_start(run)
    callbacks.step_end(Step(1, None, ((torch.zeros(32, 1, 8, 8),), {})))
    assert callbacks.log(5, {"throughput/samples_per_s": 10_000.0}) == {
        "perf/mfu": pytest.approx(7_945_728 * 10_000 / (156e12 * 2)), "memory/peak_allocated_gib": 3.0}
