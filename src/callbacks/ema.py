"""EMA weights: an exponential moving average of the model's parameters, updated after every optimizer step,
validated every epoch as `val_ema/<metric>` and saved in every checkpoint (`callbacks.ema.weights`).

`callbacks.ema.decay` (null: off) and `callbacks.ema.warmup_steps` (conf/callbacks/ema.yaml). After optimizer
step s the average moves towards the weights,

    ema = d x ema + (1 - d) x weights,   d = decay x min(1, s / warmup_steps)   (d = decay without warmup)

and the buffers (BatchNorm running statistics, num_batches_tracked) are copied from the live model, not
averaged: they are statistics of the data, not weights. The average starts from the weights the run starts
with (the initial or resumed model; a checkpoint's EMA weights replace it on resume).

`callbacks.ema.model` names the model averaged in a run of several (null: the task's output model, e.g. a GAN's
generator). The average is taken of the model's own parameters where they live: whole under dist=ddp, this
rank's shards under dist=fsdp (1/world_size of the model per rank, saved sharded and resumed on any world
size like the model). Its val metrics are the task's evaluation with the averaged parameters put into the
model for the pass (and the live ones put back after it): no second copy of the module.

Exact under DDP: after each optimizer step every rank holds the same parameters, so every rank computes
the same average with no communication, and 1 process and N ranks at the same global batch get the same
EMA (up to the float rounding their weights differ by); under FSDP each rank averages its shards, which
are the same slices of the same parameters. The update is one foreach kernel on the device
(`torch._foreach_lerp_`) with the decay a host float: no host sync. torch.optim.swa_utils.AveragedModel is
not used: its update reads its `n_averaged` counter on the host every step (a sync on GPUs), averages
buffers with `use_buffers=True` instead of leaving them to the data, keeps a full copy of the module, and
has no warmup.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from src.common.errors import UsageError
from src.config.building import check_arguments
from src.config.schema import at_least, fraction_or_null
from src.loop.callback import Callback, Run, Step
from src.loop.trainer import metric_values
from src.parallel import fsdp

log = logging.getLogger(__name__)

SPLIT, TEST_SPLIT = "val_ema", "test_ema"  # the prefixes of the EMA weights' val and test metrics


class EmaWeights:
    """The EMA of a model's parameters (`average`: a tensor like each parameter, by name, sharded like it), and its
    update. Its state_dict has the model's keys: the averaged parameters and the model's buffers."""

    def __init__(self, model: nn.Module, decay: float, warmup_steps: int = 0) -> None:
        self.model = model
        self.decay = decay
        self.warmup_steps = warmup_steps
        self.average = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}

    def decay_at(self, step: int) -> float:
        """The decay of optimizer step `step` (1 = the run's first)."""
        if self.warmup_steps == 0:
            return self.decay
        return self.decay * min(1.0, step / self.warmup_steps)

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Move the average towards the model's parameters after optimizer step `step`."""
        torch._foreach_lerp_(self._local_average(), self._local_parameters(), 1.0 - self.decay_at(step))

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The averaged parameters in the model for the block; its own back after it."""
        live = self._local_parameters()
        with torch.no_grad():
            kept = [tensor.clone() for tensor in live]
            fsdp.reshard(self.model)  # no parameters gathered before the swap are used after it
            torch._foreach_copy_(live, self._local_average())
        try:
            yield
        finally:
            with torch.no_grad():
                fsdp.reshard(self.model)
                torch._foreach_copy_(live, kept)

    def state_dict(self) -> dict[str, Any]:
        buffers = dict(self.model.named_buffers())
        return {name: self.average.get(name, buffers.get(name)) for name in _state_names(self.model)}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """The averaged parameters of `state` (whole or sharded, into whole or sharded ones); buffers are the
        model's own."""
        with torch.no_grad():
            for name, average in self.average.items():
                fsdp.copy_into(average, state[name])

    def _local_parameters(self) -> list[torch.Tensor]:
        return [fsdp.local(parameter) for parameter in self.model.parameters()]

    def _local_average(self) -> list[torch.Tensor]:
        return [fsdp.local(tensor) for tensor in self.average.values()]


def _state_names(model: nn.Module) -> list[str]:
    """The model's state_dict keys, in its order, without building one (a sharded model's would gather)."""
    persistent = [name for name, _ in model.named_parameters()]
    for module_name, module in model.named_modules():
        skipped = getattr(module, "_non_persistent_buffers_set", set())
        persistent += [f"{module_name}.{name}" if module_name else name for name, buffer in module._buffers.items()
                       if buffer is not None and name not in skipped]
    return persistent


class EMA(Callback):
    """EMA weights of a model (see the module's docstring); `decay` null: off."""

    metric_splits = (SPLIT,)

    def __init__(self, decay: float | None, warmup_steps: int, model: str | None = None) -> None:
        check_arguments(decay=(decay, fraction_or_null), warmup_steps=(warmup_steps, at_least(0)))
        self.decay, self.warmup_steps, self.model = decay, warmup_steps, model
        self.enabled = decay is not None
        self.weights: EmaWeights | None = None
        self._monitored = False

    def enable_hint(self) -> str:
        return f"EMA weights: set callbacks.{self.name}.decay (e.g. 0.999)"

    def on_run_start(self, run: Run) -> None:
        modules = run.parts.modules
        self.model = self.model or run.parts.task.output_model
        if self.model not in modules:
            raise UsageError(f"callbacks.{self.name}.model={self.model} is not a model of this run; its models: "
                             f"{', '.join(modules)}")
        # From the weights the run starts with: a resumed run's checkpoint then puts its average in (load_state_dict).
        self.weights = EmaWeights(modules[self.model], self.decay, self.warmup_steps)  # type: ignore[arg-type]
        self._monitored = (run.config.monitor or "").startswith(f"{SPLIT}/")

    def on_step_end(self, step: Step) -> None:
        self.weights.update(step.number)  # type: ignore[union-attr]  # on the device, no host sync

    def on_validation(self, run: Run, val: Mapping[str, Any]) -> dict[str, float]:
        with self.weights.applied():  # type: ignore[union-attr]
            return metric_values(SPLIT, run.evaluate(SPLIT))

    def on_test(self, run: Run, test: Mapping[str, Any]) -> dict[str, float]:
        with self.weights.applied():  # type: ignore[union-attr]
            return metric_values(TEST_SPLIT, run.evaluate(TEST_SPLIT, split="test"))

    def state_dict(self) -> dict[str, Any]:
        # `best_weights`: the weights trainer.monitor judges, so best.pt's winner (eval.py weights=...).
        return {"weights": self.weights.state_dict(), "model": self.model,  # type: ignore[union-attr]
                "best_weights": "ema" if self._monitored else "model"}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A checkpoint's average, after on_run_start (src/loop/callback.py)."""
        if state.get("model", self.model) != self.model:
            raise UsageError(f"the checkpoint's EMA weights average model {state['model']!r}, this run's "
                             f"callbacks.{self.name}.model {self.model!r}: resume with the same model")
        self.weights.load_state_dict(state["weights"])  # type: ignore[union-attr]
