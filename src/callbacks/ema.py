"""EMA weights: an exponential moving average of the model's parameters, updated after every optimizer step,
validated every epoch as `val_ema/<metric>` and saved in every checkpoint (`callbacks.ema.weights`).

`callbacks.ema.decay` (null: off) and `callbacks.ema.warmup_steps` (conf/callbacks/ema.yaml). After optimizer
step s the average moves towards the weights,

    ema = d x ema + (1 - d) x weights,   d = decay x min(1, s / warmup_steps)   (d = decay without warmup)

and the buffers (BatchNorm running statistics, num_batches_tracked) are copied from the live model, not
averaged: they are statistics of the data, not weights. The average starts from the weights the run starts
with (the initial or resumed model; a checkpoint's EMA weights replace it on resume).

Exact under DDP: after each optimizer step every rank holds the same parameters, so every rank computes
the same average with no communication, and 1 process and N ranks at the same global batch get the same
EMA (up to the float rounding their weights differ by). The update is two foreach kernels on the device
(`torch._foreach_lerp_` on the parameters, `torch._foreach_copy_` on the buffers) with the decay a host
float: no host sync. torch.optim.swa_utils.AveragedModel is not used: its update reads its `n_averaged`
counter on the host every step (a sync on GPUs), averages buffers with `use_buffers=True` instead of
copying them, and has no warmup. Under dist=fsdp it is refused: a full copy of the model on every rank is
what sharding avoids.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from src.common.errors import UsageError
from src.config.building import check_arguments
from src.config.schema import at_least, fraction_or_null
from src.loop.callback import Callback, Run, Step
from src.loop.records import metric_values
from src.parallel import fsdp

log = logging.getLogger(__name__)

SPLIT = "val_ema"  # the record's prefix of the EMA weights' val metrics


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


class EMA(Callback):
    """EMA weights of the model (see the module's docstring); `decay` null: off."""

    metric_splits = (SPLIT,)

    def __init__(self, decay: float | None, warmup_steps: int) -> None:
        check_arguments(decay=(decay, fraction_or_null), warmup_steps=(warmup_steps, at_least(0)))
        self.decay, self.warmup_steps = decay, warmup_steps
        self.enabled = decay is not None
        self.weights: EmaWeights | None = None
        self._saved: Mapping[str, Any] | None = None  # a resumed run's, until on_run_start has the model
        self._monitored = False

    def enable_hint(self) -> str:
        return f"EMA weights: set callbacks.{self.name}.decay (e.g. 0.999)"

    def on_run_start(self, run: Run) -> None:
        if fsdp.is_sharded(run.parts.module):
            raise UsageError(f"callbacks.{self.name}.decay={self.decay} keeps a full copy of the model on every rank, "
                             f"which dist=fsdp exists to avoid: use dist=ddp for EMA weights, or "
                             f"callbacks.{self.name}.decay=null")
        self.weights = EmaWeights(run.parts.module, self.decay, self.warmup_steps)  # type: ignore[arg-type]
        self._monitored = run.config.monitor.startswith(f"{SPLIT}/")
        if self._saved is not None:
            self.weights.load_state_dict(self._saved["weights"])
        elif run.resumed:  # a checkpoint of a run without EMA
            log.info("the checkpoint holds no EMA weights: the EMA starts from its model weights")

    def on_step_end(self, step: Step) -> None:
        self.weights.update(step.number)  # type: ignore[union-attr]  # on the device, no host sync

    def on_validation(self, run: Run, val: Mapping[str, Any]) -> dict[str, float]:
        return metric_values(SPLIT, run.evaluate(self.weights.module, SPLIT))  # type: ignore[union-attr]

    def state_dict(self) -> dict[str, Any]:
        # `best_weights`: the weights trainer.monitor judges, so best.pt's winner (eval.py weights=...).
        return {"weights": self.weights.state_dict(), "best_weights": "ema" if self._monitored else "model"}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._saved = state
