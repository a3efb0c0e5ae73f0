"""EMA weights: an exponential moving average of the model's parameters, updated after every optimizer step.

`trainer.ema.decay` (null: off) and `trainer.ema.warmup_steps` are declared in src/config/schema.py
(`EmaConfig`). After optimizer step s the average moves towards the weights,

    ema = d x ema + (1 - d) x weights,   d = decay x min(1, s / warmup_steps)   (d = decay without warmup)

and the buffers (BatchNorm running statistics, num_batches_tracked) are copied from the live model, not
averaged: they are statistics of the data, not weights. The average starts from the weights the run starts
with (the initial or resumed model; a checkpoint's `ema` replaces it on resume).

Exact under DDP: after each optimizer step every rank holds the same parameters, so every rank computes
the same average with no communication, and 1 process and N ranks at the same global batch get the same
EMA (up to the float rounding their weights differ by). The update is two foreach kernels on the device
(`torch._foreach_lerp_` on the parameters, `torch._foreach_copy_` on the buffers) with the decay a host
float: no host sync. torch.optim.swa_utils.AveragedModel is not used: its update reads its `n_averaged`
counter on the host every step (a sync on GPUs), averages buffers with `use_buffers=True` instead of
copying them, and has no warmup.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


class EmaWeights:
    """The EMA copy (`module`) of a model, and its update. `module` is evaluated and saved like the model:
    its state_dict has the model's keys."""

    def __init__(self, model: nn.Module, decay: float, warmup_steps: int = 0) -> None:
        self.decay = decay
        self.warmup_steps = warmup_steps
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self._live_params = list(model.parameters())
        self._ema_params = list(self.module.parameters())
        self._live_buffers = list(model.buffers())
        self._ema_buffers = list(self.module.buffers())

    def decay_at(self, step: int) -> float:
        """The decay of optimizer step `step` (1 = the run's first)."""
        if self.warmup_steps == 0:
            return self.decay
        return self.decay * min(1.0, step / self.warmup_steps)

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Move the average towards the model's weights after optimizer step `step`; copy its buffers."""
        torch._foreach_lerp_(self._ema_params, self._live_params, 1.0 - self.decay_at(step))
        if self._ema_buffers:
            torch._foreach_copy_(self._ema_buffers, self._live_buffers)

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state)
