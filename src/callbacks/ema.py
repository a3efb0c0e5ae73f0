"""EMA weights: after optimizer step s, ema = d x ema + (1 - d) x weights, d = decay x min(1, s / warmup_steps),
validated every epoch as `val_ema/<metric>` and saved in every checkpoint. Buffers are the live model's. The
average is of each rank's own parameters (its shards under dist=fsdp): no communication, no second module copy,
no host sync (torch's AveragedModel reads a counter on the host every step)."""

from __future__ import annotations

import contextlib
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

SPLIT, TEST_SPLIT = "val_ema", "test_ema"  # the prefixes of the EMA weights' val and test metrics


class EmaWeights:
    """The EMA of `model`'s parameters (`average`, sharded like them); its state_dict has the model's keys."""

    def __init__(self, model: nn.Module, decay: float, warmup_steps: int = 0) -> None:
        self.model, self.decay, self.warmup_steps = model, decay, warmup_steps
        self.average = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}

    def decay_at(self, step: int) -> float:
        """The decay of optimizer step `step` (1 = the run's first)."""
        return self.decay if self.warmup_steps == 0 else self.decay * min(1.0, step / self.warmup_steps)

    @torch.no_grad()
    def update(self, step: int) -> None:
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
        # The model's state_dict keys, every tied tensor's names, without building one (a sharded model's would gather).
        averages = dict(zip(map(id, self.model.parameters()), self.average.values()))
        state = {name: averages[id(parameter)]
                 for name, parameter in self.model.named_parameters(remove_duplicate=False)}
        for module_name, module in self.model.named_modules(remove_duplicate=False):
            skipped = getattr(module, "_non_persistent_buffers_set", set())
            state.update({f"{module_name}.{name}" if module_name else name: buffer
                          for name, buffer in module._buffers.items() if buffer is not None and name not in skipped})
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """The averaged parameters of `state` (whole or sharded, into whole or sharded ones)."""
        with torch.no_grad():
            for name, average in self.average.items():
                fsdp.copy_into(average, state[name])

    def _local_parameters(self) -> list[torch.Tensor]:
        return [fsdp.local(parameter) for parameter in self.model.parameters()]

    def _local_average(self) -> list[torch.Tensor]:
        return [fsdp.local(tensor) for tensor in self.average.values()]


class EMA(Callback):
    metric_splits = (SPLIT,)

    def __init__(self, decay: float | None, warmup_steps: int, model: str | None = None) -> None:
        check_arguments(decay=(decay, fraction_or_null), warmup_steps=(warmup_steps, at_least(0)))
        self.decay, self.warmup_steps, self.model, self.enabled = decay, warmup_steps, model, decay is not None
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
        self.weights = EmaWeights(modules[self.model], self.decay, self.warmup_steps)  # type: ignore[arg-type]
        self._monitored = (run.config.monitor or "").startswith(f"{SPLIT}/")

    def on_step_end(self, step: Step) -> None:
        self.weights.update(step.number)  # type: ignore[union-attr]

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
