"""The training loop: epochs of optimizer steps, evaluation, checkpoints and reports.

The loop only sees its settings (`TrainerConfig`) and the parts the run built (`TrainParts`: model,
optimizer, scheduler, data, checkpointer, reporter); it does not know how they were configured or
launched. Its story, in `fit`: for each epoch, train its steps (`train_one_epoch`), evaluate, record,
checkpoint, report; stop early, with a checkpoint, when `StopRule` says so (src/loop/stopping.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ContextManager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from src.common.seeding import seed_generators, step_seed
from src.config.schema import TrainerConfig
from src.data.batches import to_device
from src.data.loaders import Data
from src.loop import records
from src.loop.checkpoint import Checkpointer
from src.loop.divergence import NonFiniteLossWatch, TrainingDiverged, diverged_message
from src.loop.ema import EmaWeights
from src.loop.evaluation import evaluate, metrics_of
from src.loop.metrics import MetricSums
from src.loop.performance import FirstWindowUtilization
from src.loop.precision import autocast, autocast_dtype
from src.loop.stopping import StopReason, StopRule, early_stop_due
from src.loop.task import Task
from src.parallel import fsdp
from src.parallel.distributed import Runtime
from src.reports.reporting import Reporter

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """What the loop has done so far; saved in every checkpoint (as its top-level keys)."""

    epoch: int = 0  # epochs completed
    step: int = 0  # optimizer steps taken
    best: float | None = None  # best value of the monitored metric
    train_samples: int = 0  # training samples seen, all ranks
    train_seconds: float = 0.0  # wall time spent in training epochs
    history: list[dict[str, float]] = field(default_factory=list)
    step_in_epoch: int = 0  # optimizer steps already taken in the unfinished epoch `epoch`
    epoch_totals: dict[str, list[float]] | None = None  # its train metric sums by name, over all ranks
    early_stopped_at: int | None = None  # the epoch after which trainer.early_stopping ended the run
    pruned_at: int | None = None  # the epoch after which the sweep's pruner stopped this trial

    @classmethod
    def from_checkpoint(cls, payload: dict[str, Any]) -> "TrainState":
        """The state saved in `payload`. Other keys are ignored: those of the model and optimizer, and
        `stopped_early`, which checkpoints of earlier versions hold (always false there: a stop's
        checkpoint was written before it was set)."""
        defaults = cls()
        return cls(**{key: payload.get(key, getattr(defaults, key)) for key in cls.__dataclass_fields__})


@dataclass
class TrainParts:
    """What the run built for the loop (train.py; tests build small ones)."""

    runtime: Runtime
    task: Task
    module: nn.Module  # unwrapped: evaluated and saved
    train_model: nn.Module  # DDP and/or compiled wrapper of `module`
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data: Data
    checkpointer: Checkpointer
    reporter: Reporter
    seed: int = 0  # the run's `seed`: the loop derives per-rank step seeds (dropout) from it
    saved_config: dict[str, Any] = field(default_factory=dict)  # the resolved run config, saved in checkpoints
    profiler: torch.profiler.profile | None = None  # stepped after every optimizer step while fit() runs
    # Asked after every epoch but the last, with the history: stop the run now? (an Optuna trial's pruner,
    # src/sweeps/pruning.py). It must answer the same on every rank.
    epoch_judge: Callable[[list[dict[str, float]]], bool] | None = None


class LogWindow:
    """The optimizer steps since the last train/* scalars: the epoch's sums and the clock when it began."""

    def __init__(self, totals: torch.Tensor) -> None:
        self.totals = totals
        self.started = time.perf_counter()


class Trainer:
    """Runs `fit()` on every rank; all ranks execute the same collectives in the same order."""

    def __init__(self, config: TrainerConfig, parts: TrainParts) -> None:
        self.config = config
        self.parts = parts
        device = parts.runtime.device
        self.ddp = _find_ddp(parts.train_model)
        self.fsdp = fsdp.find(parts.train_model)  # the sharded root under dist=fsdp (src/parallel/fsdp.py)
        self.loss_watch = NonFiniteLossWatch(device)
        self.amp_dtype = autocast_dtype(config.precision)
        # fp16 needs loss scaling to keep small gradients from flushing to zero; bf16 does not.
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.amp_dtype == torch.float16)
        self.stopping = StopRule(config.max_steps, device, config.log_every_steps)  # armed while fit() runs
        self.epoch_metrics = MetricSums(parts.task.sum_shapes(parts.data.splits.info), device)
        self.utilization = FirstWindowUtilization(parts.module, device, config.precision, parts.runtime.world_size,
                                                  parts.data.train_sampler.micro_batch_size)
        # EMA weights (trainer.ema.decay), starting from the module's weights now: initial, or resumed.
        self.ema = None if config.ema.decay is None else EmaWeights(parts.module, config.ema.decay,
                                                                    config.ema.warmup_steps)

    # -- state -------------------------------------------------------------------------

    def state_dict(self, state: TrainState) -> dict[str, Any]:
        parts = self.parts
        model, optimizer = parts.module.state_dict(), parts.optimizer.state_dict()
        if parts.checkpointer.sharded:  # by parameter name, this rank's shards
            from src.loop import sharded_checkpoint  # torch.distributed.checkpoint: ~0.45 s, for sharded runs only

            model, optimizer = sharded_checkpoint.model_and_optimizer_state(parts.module, parts.optimizer)
        return {
            "model": model,
            "optimizer": optimizer,
            "scheduler": parts.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "config": parts.saved_config,
            **asdict(state),
            **({} if self.ema is None else {"ema": self.ema.state_dict()}),
            # the weights trainer.monitor judges, so best.pt's winner: evaluate it with eval.py weights=...
            "best_weights": "ema" if self.config.monitor.startswith("val_ema/") else "model",
        }

    def load_state_dict(self, payload: dict[str, Any]) -> TrainState:
        """Continue from a checkpoint: of either dist strategy, sharded or not (src/loop/sharded_checkpoint.py:
        a sharded one's model is read here, into this run's layout)."""
        module, optimizer = self.parts.module, self.parts.optimizer
        if "sharded" in payload or fsdp.is_sharded(module):  # by parameter name, resharded
            from src.loop import sharded_checkpoint  # torch.distributed.checkpoint: ~0.45 s, for these runs only

            sharded_checkpoint.restore(module, optimizer, payload)
        else:
            optimizer.load_state_dict(payload["optimizer"])
        self.parts.scheduler.load_state_dict(payload["scheduler"])
        self.scaler.load_state_dict(payload["scaler"])
        if self.ema is not None and "ema" in payload:
            self.ema.load_state_dict(payload["ema"])
        elif self.ema is not None:  # a checkpoint of a run without EMA (or of an earlier version, or sharded)
            log.info("the checkpoint holds no EMA weights: the EMA starts from its model weights")
            self.ema = EmaWeights(self.parts.module, self.config.ema.decay, self.config.ema.warmup_steps)
        return TrainState.from_checkpoint(payload)

    # -- the run -----------------------------------------------------------------------

    def fit(self, state: TrainState) -> StopReason:
        """Train from `state` (updated in place) to `config.epochs`, evaluating and checkpointing every
        epoch. Stops early, with a checkpoint to resume from, after `config.max_steps` optimizer steps
        or when the process is asked to terminate (SIGTERM: preemption); or, after an epoch's checkpoint,
        when `config.early_stopping` says the monitored metric stopped improving, or when the epoch judge
        (a sweep trial's pruner) says stop (a run resumed after either trains no more). Returns why it stopped."""
        ended = _ended_before(state)
        if ended is not None:
            return ended
        profiling = self.parts.profiler if self.parts.profiler is not None else contextlib.nullcontext()
        with self.stopping, profiling, torch.autograd.set_detect_anomaly(self.config.detect_anomaly):
            for epoch in range(state.epoch, self.config.epochs):
                started = time.perf_counter()
                train = self.train_one_epoch(epoch, state)
                if isinstance(train, StopReason):
                    return train
                self._end_epoch(epoch, state, train, started)
                if state.early_stopped_at is not None:
                    return StopReason.EARLY_STOPPED
                if state.pruned_at is not None:
                    return StopReason.PRUNED
        return StopReason.COMPLETED

    def train_one_epoch(self, epoch: int, state: TrainState) -> dict[str, float] | StopReason:
        """One epoch's optimizer steps, from `state.step_in_epoch` on (a resumed epoch goes on where it
        stopped, with the same remaining samples). Returns its train metrics, or why the run stopped
        before the epoch's end (after a step checkpoint)."""
        restored = self._start_epoch(epoch, state)
        window = LogWindow(self.epoch_metrics.totals())
        steps_per_epoch = self.parts.data.train_sampler.steps_per_epoch
        progress = self.parts.reporter.progress(f"epoch {epoch + 1}/{self.config.epochs}", steps_per_epoch,
                                                done=state.step_in_epoch)
        for micro_step, batch in enumerate(self.parts.data.train_loader):
            if not self._micro_step(micro_step, batch, state):
                continue  # gradients accumulate: no optimizer step yet
            progress.update()
            stop = self._after_step(state, window)
            if stop is not None:
                progress.close()
                self._save_mid_epoch(state)
                return stop
        state.step_in_epoch = 0
        progress.close()
        return self._epoch_train_metrics(restored)

    def evaluate(self, module: nn.Module | None = None, desc: str = "val") -> dict[str, Any]:
        """The task's metrics (and val tables) of `module` (default: the model) over the whole val split,
        each sample counted once."""
        parts = self.parts
        module = parts.module if module is None else module
        return evaluate(module, parts.reporter.track(parts.data.val_loader, desc), parts.task, parts.data.splits.info,
                        parts.runtime.device, self.amp_dtype, lockstep=fsdp.is_sharded(module))

    def summary(self, state: TrainState, num_val_samples: int) -> dict[str, Any]:
        """The run so far, as written to metrics.json: the last epoch's metrics and the history, the
        parameter elements trainer.freeze froze, and whether (and after which epoch) early stopping ended it."""
        summary = records.run_summary(state.history, num_val_samples, self.parts.runtime.world_size,
                                      self.parts.data.train_sampler.global_batch_size,
                                      state.train_samples / state.train_seconds)
        summary["frozen_parameters"] = sum(p.numel() for p in self.parts.module.parameters() if not p.requires_grad)
        if state.early_stopped_at is not None:
            summary.update(stop_reason=StopReason.EARLY_STOPPED.value, stopped_at_epoch=state.early_stopped_at)
        if state.pruned_at is not None:
            summary.update(stop_reason=StopReason.PRUNED.value, stopped_at_epoch=state.pruned_at)
        return summary

    # -- an epoch ----------------------------------------------------------------------

    def _start_epoch(self, epoch: int, state: TrainState) -> dict[str, list[float]] | None:
        """Point the sampler at the epoch (and the resumed step; its samples' augmentation follows from
        them), and start the epoch's sums: from zero, or those a step checkpoint saved. Returns those
        restored sums."""
        self.parts.data.train_sampler.set_epoch(epoch, start_step=state.step_in_epoch)
        self.parts.train_model.train()
        self.epoch_metrics.reset()
        restored = _named_totals(state.epoch_totals)  # the sums of a resumed epoch's first steps
        if restored is not None and self.parts.runtime.is_main_process:
            self.epoch_metrics.load_state_dict(restored)  # all ranks' sums: added once, on rank 0
        state.epoch_totals = None
        return restored

    def _micro_step(self, micro_step: int, batch: Any, state: TrainState) -> bool:
        """Forward and backward one micro-batch; on the step's last one, the optimizer step too.
        Returns whether an optimizer step was taken."""
        accum, device = self.config.grad_accum, self.parts.runtime.device
        if micro_step % accum == 0:
            # Seeded per optimizer step (differently per rank): dropout draws the same after a resume
            # at any step, and independently across ranks. (Augmentation draws per sample, in the loader.)
            seed_generators(step_seed(self.parts.seed, self.parts.runtime.env.rank, state.step), device)
        batch = to_device(batch, device)
        is_step_end = (micro_step + 1) % accum == 0
        self._forward_backward(batch, sync=is_step_end, step=state.step + 1)
        if is_step_end:
            self._optimizer_step()
            state.step += 1
            if self.ema is not None:
                self.ema.update(state.step)  # on the device, no host sync (src/loop/ema.py)
            if self.parts.profiler is not None:
                self.parts.profiler.step()
            if self.config.detect_anomaly:
                self.loss_watch.check_now()
            state.step_in_epoch += 1
        return is_step_end

    def _after_step(self, state: TrainState, window: LogWindow) -> StopReason | None:
        """After an optimizer step: the log window's scalars, then why to stop (the caller checkpoints),
        or else a periodic step checkpoint if one is due."""
        if state.step % self.config.log_every_steps == 0:
            self._report_window(state.step, window)
        stop = self.stopping.reason(state.step)
        if stop is not None:
            return stop
        every = self.config.checkpoint_every_steps
        if every and state.step % every == 0 and state.step_in_epoch < self.parts.data.train_sampler.steps_per_epoch:
            self._save_mid_epoch(state)
        return None

    def _epoch_train_metrics(self, restored: dict[str, list[float]] | None) -> dict[str, float]:
        """The finished epoch's train metrics over all ranks, with `timed_count`: the samples trained
        (and timed) by this run, not those restored from a checkpoint."""
        metrics = metrics_of(self.parts.task, self.epoch_metrics.reduce())
        self.loss_watch.check(metrics["loss"])
        metrics["timed_count"] = metrics["count"] - (int(restored["count"][0]) if restored is not None else 0)
        return metrics

    def _end_epoch(self, epoch: int, state: TrainState, train: dict[str, float], started: float) -> None:
        """Evaluate, record the epoch in `state`, report it and checkpoint."""
        train_seconds = time.perf_counter() - started
        val = self.evaluate()
        val_ema = None if self.ema is None else self.evaluate(self.ema.module, "val_ema")
        state.epoch = epoch + 1
        state.train_samples += train["timed_count"]
        state.train_seconds += train_seconds
        record = records.epoch_record(state.epoch, state.step, train, val, self._lr(),
                                      time.perf_counter() - started, train_seconds, val_ema)
        state.history.append(record)
        is_best = self._improves(state, record[self.config.monitor])
        self._check_early_stop(state)  # before the checkpoint, which then holds the decision
        self._ask_epoch_judge(state)  # likewise
        self.parts.reporter.scalars(records.epoch_scalars(record), record["step"])
        log.info("%s", records.epoch_line(record, self.config.epochs, val["count"]))
        if self.config.save_checkpoints:
            self.parts.checkpointer.save(self.state_dict(state), is_best)
        # After the checkpoint: metrics.json never reports an epoch a restart would lose.
        self.parts.reporter.write_metrics(self.summary(state, val["count"]))
        if "confusion" in val:
            self.parts.reporter.confusion_matrix(val["confusion"], state.step)

    # -- a step ------------------------------------------------------------------------

    def _forward_backward(self, batch: Any, sync: bool, step: int) -> None:
        task, accum = self.parts.task, self.config.grad_accum
        args, kwargs, target = task.split(batch)
        self.utilization.see_inputs(args, kwargs)  # shapes for counting FLOPs (src/loop/performance.py)
        # On micro-steps before the last one, DDP must not all-reduce gradients yet, nor FSDP reduce-scatter them.
        sync_context: ContextManager[Any] = contextlib.nullcontext()
        if self.ddp is not None and not sync:
            sync_context = self.ddp.no_sync()
        elif self.fsdp is not None and not sync:
            sync_context = fsdp.no_gradient_sync(self.fsdp)
        with sync_context:
            with autocast(self.parts.runtime.device, self.amp_dtype):
                outputs = self.parts.train_model(*args, **kwargs)
            loss_sum, count = task.loss(outputs, target)
            # Each micro-batch holds 1/accum of the rank's samples; DDP averages over ranks,
            # so the gradient is the mean over the global batch.
            loss = loss_sum / (count * accum)
            self.loss_watch.observe(loss_sum, step)
            self._backward(loss, step)
        self.epoch_metrics.add(task.batch_sums(outputs, target, loss_sum, count))

    def _backward(self, loss: torch.Tensor, step: int) -> None:
        try:
            self.scaler.scale(loss).backward()
        except RuntimeError as error:  # anomaly mode names the backward op that made a NaN
            if not self.config.detect_anomaly or "nan values" not in str(error):
                raise
            what = str(error).splitlines()[0].rstrip(".")
            raise TrainingDiverged(diverged_message(step, what, names_the_op=True)) from None

    def _optimizer_step(self) -> None:
        optimizer = self.parts.optimizer
        if self.config.grad_clip is not None:
            self.scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(self.parts.module.parameters(), self.config.grad_clip)
        self.scaler.step(optimizer)
        self.scaler.update()
        optimizer.zero_grad(set_to_none=True)
        self.parts.scheduler.step()

    def _save_mid_epoch(self, state: TrainState) -> None:
        """A step checkpoint: the model and everything needed to go on from this very step."""
        state.epoch_totals = self.epoch_metrics.state_dict()
        self.loss_watch.check(state.epoch_totals["loss"][0])  # never checkpoint a diverged model
        if self.config.save_checkpoints:
            self.parts.checkpointer.save(self.state_dict(state), is_best=False, step=state.step)
        state.epoch_totals = None
        log.info("checkpoint at step %d (epoch %d, step %d of %d)", state.step, state.epoch + 1,
                 state.step_in_epoch, self.parts.data.train_sampler.steps_per_epoch)

    # -- helpers -----------------------------------------------------------------------

    def _lr(self) -> float:
        return self.parts.optimizer.param_groups[0]["lr"]

    def _improves(self, state: TrainState, value: float) -> bool:
        better = state.best is None or (
            value > state.best if self.config.monitor_mode == "max" else value < state.best
        )
        if better:
            state.best = value
        return better

    def _check_early_stop(self, state: TrainState) -> None:
        """Mark the run early stopped if the monitored metric has not improved for `patience` epochs (and
        epochs remain). Every rank decides alike: the history's metrics are all-reduced."""
        rule, monitor = self.config.early_stopping, self.config.monitor
        values = [record[monitor] for record in state.history]
        if state.epoch < self.config.epochs and early_stop_due(values, self.config.monitor_mode, rule.patience,
                                                                rule.min_delta):
            state.early_stopped_at = state.epoch
            log.info("early stopping after epoch %d: %s has not improved by more than %g for %d epochs",
                     state.epoch, monitor, rule.min_delta, rule.patience)

    def _ask_epoch_judge(self, state: TrainState) -> None:
        """Mark the run pruned if the epoch judge (a sweep trial's pruner) says so, while epochs remain."""
        judge = self.parts.epoch_judge
        if judge is not None and state.early_stopped_at is None and state.epoch < self.config.epochs \
                and judge(state.history):
            state.pruned_at = state.epoch
            log.info("pruned after epoch %d: the sweep's pruner stopped this trial", state.epoch)

    def _report_window(self, step: int, window: LogWindow) -> None:
        seconds = time.perf_counter() - window.started
        metrics = metrics_of(self.parts.task, self.epoch_metrics.reduce(baseline=window.totals))
        self.loss_watch.check(metrics["loss"])
        window.totals = self.epoch_metrics.totals()
        samples_per_s = metrics["count"] / seconds
        scalars = records.window_scalars(metrics, self._lr(), samples_per_s)
        # MFU and peak memory on GPUs of known peak
        self.parts.reporter.scalars({**scalars, **self.utilization.scalars(samples_per_s)}, step)
        window.started = time.perf_counter()


def _ended_before(state: TrainState) -> StopReason | None:
    """Why a resumed run has nothing more to train: early stopping or the sweep's pruner ended it."""
    if state.early_stopped_at is not None:
        log.info("early stopping had ended this run after epoch %d: nothing more to train", state.early_stopped_at)
        return StopReason.EARLY_STOPPED
    if state.pruned_at is not None:
        log.info("the sweep's pruner had ended this trial after epoch %d: nothing more to train", state.pruned_at)
        return StopReason.PRUNED
    return None


def _named_totals(saved: Any) -> dict[str, list[float]] | None:
    """Epoch sums saved by name; a checkpoint of a version that kept them as (loss, correct, count)
    is read as classification's sums."""
    if isinstance(saved, (list, tuple)):
        loss, correct, count = saved[:3]
        return {"loss": [loss], "count": [count], "correct": [correct]}
    return saved


def _find_ddp(model: nn.Module) -> DistributedDataParallel | None:
    """The DDP wrapper inside `model` (possibly under torch.compile's wrapper), if any."""
    inner = getattr(model, "_orig_mod", model)
    return inner if isinstance(inner, DistributedDataParallel) else None
