"""The contract between the loop and its add-ons: a `Callback` is told what the loop does at a few named points, and may
report, change what it shows, or stop the run. The template's own add-ons are callbacks (src/callbacks/), composed from
the `callbacks` config group; the loop names none of them. Every hook is called on every rank, in the config's order:

    on_run_start(run)                  before the first step: the run's parts and its state (fresh or resumed)
    on_before_optimizer_step(update)   before each optimizer's step, its gradients all-reduced (under dist=fsdp:
                                       this rank's shards) and unscaled, before trainer.grad_clip
    on_step_end(step)                  after each training step: its number, its summed loss (a device tensor:
                                       never read it on the host here, that stalls every step) and the model
                                       inputs of its first micro-batch (None if the task's step sets none)
    on_log(step, scalars)              at log steps, with the window's all-reduced train scalars; returns more
    on_validation(run, val)            after the epoch's val pass, with its metrics; returns more metrics
    on_test(run, test)                 once, after the final test of the chosen weights; returns more metrics
    on_epoch_end(run, record)          with the epoch's record; returns an `EndRun` to end the run after this
                                       epoch (rank 0's decision is every rank's)
    on_checkpoint(run)                 before a checkpoint is written; raise to refuse it
    on_run_end(run, outcome)           after the last step, however training ended (an `Outcome`)
    on_exception(run, error)           when the loop raises; may raise a clearer error in its place
    state_dict() / load_state_dict()   saved in every checkpoint under the callback's name; given back right
                                       after `on_run_start` when a run resumes

Only the callbacks that override a hook are called for it, and a callback that sets `enabled = False` (in its
constructor or `on_run_start`) is never called again and saves no state."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from src.config.building import errors_named
from src.loop.step import Update  # noqa: F401 - what on_before_optimizer_step is given
from src.parallel.distributed import broadcast_object

if TYPE_CHECKING:  # annotations only
    from src.checkpoint.store import Store
    from src.config.schema import TrainerConfig
    from src.data.loaders import Data
    from src.loop.task import Task
    from src.parallel.distributed import Runtime
    from src.reports.reporting import Reporter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    """A training step, as `on_step_end` sees it."""

    number: int  # training steps taken so far, this one included (1 = the run's first)
    loss: torch.Tensor | None  # the losses it back-propagated, summed, on the device
    inputs: tuple[tuple[Any, ...], dict[str, Any]] | None  # its first micro-batch's (positional, keyword) inputs


@dataclass(frozen=True)
class EndRun:
    """A callback's decision to end the run after this epoch, for good (kept in the checkpoint: `TrainState.ended`)."""

    reason: str  # metrics.json's stop_reason, e.g. early_stopped, pruned
    message: str  # logged when the run ends, e.g. "early stopping after epoch 3: ..."
    ended_by: str  # a resumed run's log: "<ended_by> after epoch N: nothing more to train"
    epoch: int = 0  # the epoch it ended after (set by the loop)


class Outcome(Enum):
    """How training ended; every rank reaches the same outcome at the same step."""

    COMPLETED = "completed"  # every epoch trained
    MAX_STEPS = "max_steps"  # trainer.max_steps optimizer steps taken, with a checkpoint
    PREEMPTED = "preempted"  # a rank got SIGTERM or SIGUSR2, with a checkpoint
    ENDED = "ended"  # a callback ended the run after an epoch (an `EndRun`), with that epoch's checkpoint

    @property
    def is_final(self) -> bool:
        """Whether the run is over (an interruption, to continue with resume=auto, is not)."""
        return self in (Outcome.COMPLETED, Outcome.ENDED)


@dataclass
class Run:
    """What the loop shows its callbacks: its settings, the parts the run built, and its state so far."""

    config: TrainerConfig
    parts: TrainParts
    state: TrainState
    resumed: bool  # the run continues from a checkpoint
    evaluate: Callable[..., dict[str, Any]]  # evaluate(desc, split="val"): the models' metrics now, on the whole split


class Callback:
    """The base of every add-on: each hook does nothing. `name` is its key in the config (`callbacks.<name>`) and in
    checkpoints; `metric_splits`: metric prefixes `on_validation` adds (`val_ema`), which `trainer.monitor` may name."""

    name: str = ""
    enabled: bool = True
    metric_splits: tuple[str, ...] = ()

    def on_run_start(self, run: Run) -> None: ...
    def on_before_optimizer_step(self, update: Update) -> None: ...
    def on_step_end(self, step: Step) -> None: ...
    def on_log(self, step: int, scalars: Mapping[str, float]) -> Mapping[str, float] | None: ...
    def on_validation(self, run: Run, val: Mapping[str, Any]) -> Mapping[str, float] | None: ...
    def on_test(self, run: Run, test: Mapping[str, Any]) -> Mapping[str, float] | None: ...
    def on_epoch_end(self, run: Run, record: Mapping[str, float]) -> EndRun | None: ...
    def on_checkpoint(self, run: Run) -> None: ...
    def on_run_end(self, run: Run, outcome: Outcome) -> None: ...
    def on_exception(self, run: Run, error: BaseException) -> None: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def enable_hint(self) -> str | None:
        """When disabled: what turns it on, for a `trainer.monitor` naming one of its `metric_splits`."""
        return None


HOOKS = tuple(name for name in vars(Callback) if name.startswith("on_"))  # in the order Callback declares them


class Callbacks:
    """The run's callbacks, in config order, called hook by hook (only the enabled ones that override it)."""

    def __init__(self, callbacks: Mapping[str, Callback] | None = None) -> None:
        self.all = dict(callbacks or {})
        for name, callback in self.all.items():
            callback.name = name
        self._update_hooks()

    def _update_hooks(self) -> None:
        enabled = [callback for callback in self.all.values() if callback.enabled]
        self._by_hook: dict[str, list[Callback]] = {
            hook: [callback for callback in enabled if getattr(type(callback), hook) is not getattr(Callback, hook)]
            for hook in HOOKS}

    def _call(self, hook: str, *args: Any) -> list[Any]:
        return [getattr(callback, hook)(*args) for callback in self._by_hook[hook]]

    def _merged(self, hook: str, *args: Any) -> dict[str, float]:
        return {key: value for more in self._call(hook, *args) for key, value in (more or {}).items()}

    @property
    def metric_splits(self) -> tuple[str, ...]:
        return tuple(split for callback in self.all.values() if callback.enabled for split in callback.metric_splits)

    def enable_hints(self) -> dict[str, str]:
        """For each metric prefix a disabled callback would add: what turns it on."""
        return {split: hint for callback in self.all.values() if not callback.enabled
                for split in callback.metric_splits if (hint := callback.enable_hint())}

    def run_start(self, run: Run) -> None:
        self._call("on_run_start", run)
        self._update_hooks()  # a callback may have found nothing to do in this run

    def before_optimizer_step(self, update: Update) -> None:
        self._call("on_before_optimizer_step", update)

    def step_end(self, step: Step) -> None:
        self._call("on_step_end", step)

    def log(self, step: int, scalars: Mapping[str, float]) -> dict[str, float]:
        return self._merged("on_log", step, scalars)

    def validation(self, run: Run, val: Mapping[str, Any]) -> dict[str, float]:
        return self._merged("on_validation", run, val)

    def test(self, run: Run, test: Mapping[str, Any]) -> dict[str, float]:
        return self._merged("on_test", run, test)

    def epoch_end(self, run: Run, record: Mapping[str, float]) -> EndRun | None:
        """The first `EndRun` a callback returns, as rank 0 decided it (ranks that went on would wait forever for those
        that stopped); every callback is asked (their collectives). A collective."""
        if not self._by_hook["on_epoch_end"]:
            return None
        stop = next((stop for stop in self._call("on_epoch_end", run, record) if stop is not None), None)
        return broadcast_object(stop)  # type: ignore[return-value]

    def checkpoint(self, run: Run) -> None:
        self._call("on_checkpoint", run)

    def run_end(self, run: Run, outcome: Outcome) -> None:
        self._call("on_run_end", run, outcome)

    def exception(self, run: Run, error: BaseException) -> None:
        self._call("on_exception", run, error)

    def state_dict(self) -> dict[str, Any]:
        """Each enabled callback's state, under its name (callbacks without state save nothing)."""
        states = {name: callback.state_dict() for name, callback in self.all.items() if callback.enabled}
        return {name: state for name, state in states.items() if state}

    def load_state_dict(self, states: Mapping[str, Any]) -> None:
        for name, state in states.items():
            if (callback := self.all.get(name)) is not None and callback.enabled:
                callback.load_state_dict(state)
            else:
                log.info("the checkpoint's state of callback %s is not used: this run has no such callback on", name)
        for name in self.state_dict().keys() - states.keys():
            log.info("the checkpoint holds no state of callback %s: it starts from this run's", name)


@dataclass
class TrainState:
    """What the loop has done so far; saved in every checkpoint as its `loop` part."""

    epoch: int = 0  # epochs completed
    step: int = 0  # optimizer steps taken
    best: float | None = None  # best value of the monitored metric
    train_samples: int = 0  # training units seen, all ranks (the task's count: samples, tokens, ...)
    train_seconds: float = 0.0  # wall time spent in training epochs
    history: list[dict[str, float]] = field(default_factory=list)
    step_in_epoch: int = 0  # optimizer steps already taken in the unfinished epoch `epoch`
    epoch_totals: dict[str, list[float]] | None = None  # its train metric sums, over all ranks
    ended: EndRun | None = None  # why and after which epoch a callback ended the run
    test: dict[str, Any] | None = None  # the final test: its step, the weights tested, their test/* metrics

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """The saved fields; a field the checkpoint lacks keeps its default."""
        for known in fields(self):
            if known.name in saved:
                setattr(self, known.name, saved[known.name])
        if isinstance(self.ended, Mapping):
            self.ended = EndRun(**self.ended)


@dataclass
class TrainParts:
    """What the run built for the loop."""

    runtime: Runtime
    task: Task
    modules: dict[str, nn.Module]  # each trained model by name, unwrapped: evaluated and saved (sharded: dist=fsdp)
    train_models: dict[str, nn.Module]  # the same, as the step calls them: DDP's and/or torch.compile's wrappers
    optimizers: dict[str, torch.optim.Optimizer]  # each model's, by its name
    schedulers: dict[str, torch.optim.lr_scheduler.LRScheduler]  # each optimizer's, by its name
    data: Data
    store: Store  # where checkpoints go, in the run's format (src/checkpoint/)
    reporter: Reporter
    callbacks: Callbacks = field(default_factory=Callbacks)  # the run's add-ons, in config order
    seed: int = 0  # the run's `seed`: the loop derives per-rank step seeds (dropout) from it
    saved_config: dict[str, Any] = field(default_factory=dict)  # the resolved run config, saved in checkpoints


def build_callbacks(callbacks_cfg: DictConfig, trackers: Callback) -> Callbacks:
    """The run's callbacks (conf/callbacks/) in config order, after the `trackers` (told of a failure first)."""
    built = {"trackers": trackers}
    for name, node in callbacks_cfg.items():
        with errors_named(f"callbacks.{name}", node):
            built[str(name)] = instantiate(node)
    return Callbacks(built)
