"""`perf/mfu` (the model's training FLOPs per sample, counted once on a meta-device copy, x samples/s / the GPUs'
dense peak) and `memory/peak_allocated_gib`, at every log step; only on GPUs listed in `PEAK_TFLOPS`."""

from __future__ import annotations

import re
from collections.abc import Mapping
from copy import deepcopy
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from src.data.batches import tree_map
from src.loop.callback import Callback, Run, Step

# Dense peak TFLOP/s per GPU (first pattern matching the lower-cased device name) by matmul precision; a precision a
# GPU lacks is absent (tf32 falls back to fp32). Sources: NVIDIA's datasheets (sparse figures halved), whitepapers.
PEAK_TFLOPS: tuple[tuple[str, Mapping[str, float]], ...] = (
    (r"h[12]00 nvl", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    (r"h100.*(pcie|hbm2e)", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5}),
    (r"h100|h200", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),  # SXM
    (r"a100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),  # SXM and PCIe alike
    (r"\ba40\b", {"fp32": 37.4, "tf32": 74.8, "bf16": 149.7, "fp16": 149.7}),
    (r"\ba10\b", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    (r"l40s", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05}),
    (r"\bl4\b", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    (r"v100s", {"fp32": 16.4, "fp16": 130.0}),
    (r"v100.*sxm", {"fp32": 15.7, "fp16": 125.0}),
    (r"v100", {"fp32": 14.0, "fp16": 112.0}),  # PCIe
    (r"\bt4\b", {"fp32": 8.1, "fp16": 65.0}),
    (r"rtx 3090", {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0}),
    (r"rtx 4090", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2}),
)
GIB = 2**30


def peak_flops(device_name: str, precision: str, tf32: bool) -> float | None:
    """Dense peak FLOP/s of a `device_name` GPU at `trainer.precision` (32 | bf16 | 16), None if not listed."""
    name = device_name.lower()
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, name):
            key = {"32": "tf32" if tf32 else "fp32", "bf16": "bf16", "16": "fp16"}[precision]
            tflops = peaks.get(key, peaks["fp32"] if key == "tf32" else None)
            return None if tflops is None else tflops * 1e12
    return None


def device_peak(device: torch.device, precision: str) -> float | None:
    if device.type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(device), str(precision), torch.backends.cuda.matmul.allow_tf32)


def training_flops_per_sample(model: nn.Module, inputs: tuple[tuple[Any, ...], dict[str, Any]],
                              batch_size: int) -> float:
    """FLOPs of one training sample (matmuls and convolutions, forward and backward), counted on a meta-device
    copy of `model` in eval mode (no memory; sync-BN does not all-reduce) from model `inputs` (meta tensors)."""
    # deepcopy takes memo entries as the copies of those objects: meta twins of the weights.
    meta = {id(t): nn.Parameter(torch.empty_like(t, device="meta"), t.requires_grad) for t in model.parameters()}
    meta.update({id(t): torch.empty_like(t, device="meta") for t in model.buffers()})
    copy = deepcopy(model, meta).eval()
    args, kwargs = inputs
    with FlopCounterMode(display=False) as counter:
        copy(*args, **kwargs).float().sum().backward()
    return counter.get_total_flops() / batch_size


def mfu(flops_per_sample: float, samples_per_s: float, peak_flops_per_device: float, world_size: int) -> float:
    """The fraction of the group's peak the model's FLOPs use; `samples_per_s` counts all ranks' samples."""
    return flops_per_sample * samples_per_s / (peak_flops_per_device * world_size)


class Utilization:
    """`perf/mfu` and `memory/peak_allocated_gib` of each log window; none on the CPU or an unlisted GPU."""

    def __init__(self, model: nn.Module, device: torch.device, precision: str, world_size: int,
                 example_inputs: tuple[tuple[Any, ...], dict[str, Any]] | None, micro_batch_size: int) -> None:
        self.device, self.world_size = device, world_size
        self.peak = device_peak(device, precision)
        counted = self.peak is not None and example_inputs is not None
        self.flops_per_sample = training_flops_per_sample(model, example_inputs, micro_batch_size) if counted else 0.0

    def scalars(self, samples_per_s: float) -> dict[str, float]:
        if self.peak is None:
            return {}
        return {"perf/mfu": mfu(self.flops_per_sample, samples_per_s, self.peak, self.world_size),
                "memory/peak_allocated_gib": torch.cuda.max_memory_allocated(self.device) / GIB}


class MFU(Callback):
    """`Utilization` at every log step, built at the first from the first micro-batch's shapes (meta tensors)."""

    def __init__(self) -> None:
        self.example_inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self.utilization: Utilization | None = None
        self._run: Run | None = None

    def on_run_start(self, run: Run) -> None:
        self.enabled = device_peak(run.parts.runtime.device, run.config.precision) is not None
        self._run = run

    def on_step_end(self, step: Step) -> None:
        if self.example_inputs is None:
            self.example_inputs = tree_map(lambda t: torch.empty_like(t, device="meta"), step.inputs)

    def on_log(self, step: int, scalars: Mapping[str, float]) -> dict[str, float]:
        if self.utilization is None:
            parts = self._run.parts  # type: ignore[union-attr]
            model = parts.modules[parts.task.output_model]  # the model the step's first micro-batch fed
            self.utilization = Utilization(model, parts.runtime.device, str(self._run.config.precision),
                                           parts.runtime.world_size, self.example_inputs,
                                           parts.data.train_sampler.micro_batch_size)
        return self.utilization.scalars(scalars["throughput/samples_per_s"])
