"""The training loop: epochs of optimizer steps, evaluation, checkpoints and reports.

The loop only sees prepared components (model, optimizer, scheduler, loaders,
checkpointer, reporter); it does not know how they were configured or launched.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, ContextManager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from src.common.seeding import epoch_seed, seed_generators, step_seed
from src.data.batches import tree_map
from src.data.loaders import Data, train_batch_to_device
from src.loop.checkpoint import Checkpointer
from src.loop.divergence import NonFiniteLossWatch, TrainingDiverged, diverged_message
from src.loop.evaluation import evaluate, metrics_of
from src.loop.metrics import MetricSums
from src.loop.performance import Utilization
from src.loop.precision import autocast, autocast_dtype
from src.loop.task import Task
from src.parallel.distributed import Runtime
from src.parallel.preemption import Preemption
from src.reports.reporting import Reporter

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """What the loop has done so far; saved in every checkpoint."""

    epoch: int = 0  # epochs completed
    step: int = 0  # optimizer steps taken
    best: float | None = None  # best value of the monitored metric
    train_samples: int = 0  # training samples seen, all ranks
    train_seconds: float = 0.0  # wall time spent in training epochs
    history: list[dict[str, float]] = field(default_factory=list)
    step_in_epoch: int = 0  # optimizer steps already taken in the unfinished epoch `epoch`
    epoch_totals: dict[str, list[float]] | None = None  # its train metric sums by name, over all ranks
    stopped_early: bool = False  # the run stopped before its last epoch (max_steps, SIGTERM)


@dataclass
class TrainerOptions:
    epochs: int
    seed: int = 0
    precision: str = "32"
    grad_accum: int = 1
    grad_clip: float | None = None
    log_every_steps: int = 50
    save_checkpoints: bool = True
    monitor: str = "val/acc"
    monitor_mode: str = "max"
    checkpoint_every_steps: int | None = None  # also checkpoint mid-epoch every N optimizer steps
    max_steps: int | None = None  # stop (with a checkpoint) after this many optimizer steps in all
    detect_anomaly: bool = False  # autograd anomaly mode, and a NaN check every step (slow; for debugging)

    @classmethod
    def from_config(cls, trainer_cfg: Any, seed: int) -> "TrainerOptions":
        """Options from the config's `trainer` block (keys not used by the loop are skipped)."""
        return cls(seed=seed, **{name: trainer_cfg[name] for name in cls.__dataclass_fields__ if name != "seed"})


class Trainer:
    """Runs `fit()` on every rank; all ranks execute the same collectives in the same order."""

    def __init__(
        self,
        options: TrainerOptions,
        runtime: Runtime,
        task: Task,
        module: nn.Module,
        train_model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        data: Data,
        checkpointer: Checkpointer,
        reporter: Reporter,
        profiler: torch.profiler.profile | None = None,
    ) -> None:
        self.options = options
        self.runtime = runtime
        self.task = task
        self.module = module  # unwrapped: evaluated and saved
        self.train_model = train_model  # DDP and/or compiled wrapper of `module`
        self.ddp = _find_ddp(train_model)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.data = data
        self.checkpointer = checkpointer
        self.reporter = reporter
        self.profiler = profiler  # stepped after every optimizer step while fit() runs
        self.loss_watch = NonFiniteLossWatch(runtime.device)
        self.amp_dtype = autocast_dtype(options.precision)
        # fp16 needs loss scaling to keep small gradients from flushing to zero; bf16 does not.
        self.scaler = torch.amp.GradScaler(runtime.device.type, enabled=self.amp_dtype == torch.float16)
        self.preemption = Preemption(runtime.device, options.log_every_steps)  # armed while fit() runs
        self.run_config: dict[str, Any] = {}  # the resolved config, saved in checkpoints
        self.epoch_metrics = MetricSums(task.sum_shapes(data.splits.info), runtime.device)
        self.window_start = self.epoch_metrics.totals()  # the epoch totals when the log window began
        self.example_inputs: tuple[Any, ...] | None = None  # the first micro-batch's inputs, on the meta device

    # -- state -------------------------------------------------------------------------

    def state_dict(self, state: TrainState, config: dict[str, Any]) -> dict[str, Any]:
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "config": config,
            **asdict(state),
        }

    def load_state_dict(self, payload: dict[str, Any]) -> TrainState:
        self.optimizer.load_state_dict(payload["optimizer"])
        self.scheduler.load_state_dict(payload["scheduler"])
        self.scaler.load_state_dict(payload["scaler"])
        defaults = TrainState()
        return TrainState(**{key: payload.get(key, getattr(defaults, key)) for key in TrainState.__dataclass_fields__})

    # -- the run -----------------------------------------------------------------------

    def fit(self, state: TrainState, config: dict[str, Any]) -> TrainState:
        """Train from `state` to `options.epochs`, evaluating and checkpointing every epoch.

        Stops early, with a checkpoint to resume from, after `options.max_steps` optimizer
        steps or when the process is asked to terminate (SIGTERM: preemption).
        """
        self.run_config = config
        profiling = self.profiler if self.profiler is not None else contextlib.nullcontext()
        with self.preemption, profiling, torch.autograd.set_detect_anomaly(self.options.detect_anomaly):
            for epoch in range(state.epoch, self.options.epochs):
                started = time.perf_counter()
                train = self.train_one_epoch(epoch, state)
                if state.stopped_early:
                    return state
                train_seconds = time.perf_counter() - started
                val = self.evaluate()
                state.epoch = epoch + 1
                state.train_samples += train["timed_count"]
                state.train_seconds += train_seconds
                record = {
                    "epoch": state.epoch,
                    "step": state.step,
                    **metric_values("train", train),  # train/loss and the task's metrics
                    **metric_values("val", val),
                    "lr": self.optimizer.param_groups[0]["lr"],
                    "epoch_time_s": time.perf_counter() - started,
                    "samples_per_s": train["timed_count"] / train_seconds,
                }
                state.history.append(record)
                is_best = self._improves(state, record[self.options.monitor])
                self._report_epoch(record, val["count"])
                if self.options.save_checkpoints:
                    self.checkpointer.save(self.state_dict(state, config), is_best)
                # After the checkpoint: metrics.json never reports an epoch a restart would lose.
                self.reporter.write_metrics(self.summary(state, val["count"]))
                if "confusion" in val:
                    self.reporter.confusion_matrix(val["confusion"], state.step)
        return state

    def train_one_epoch(self, epoch: int, state: TrainState) -> dict[str, float]:
        """One epoch's optimizer steps, from `state.step_in_epoch` on (a resumed epoch goes on
        where it stopped, with the same remaining samples). Returns its train metrics."""
        sampler = self.data.train_sampler
        sampler.set_epoch(epoch, start_step=state.step_in_epoch)
        generator = getattr(self.data.train_loader, "generator", None)  # a DataLoader's: seeds its workers
        if generator is not None:
            generator.manual_seed(epoch_seed(self.options.seed, self.runtime.env.rank, epoch))
        self.train_model.train()
        self.epoch_metrics.reset()
        restored = _named_totals(state.epoch_totals)  # the sums of a resumed epoch's first steps
        if restored is not None and self.runtime.is_main_process:
            self.epoch_metrics.load_state_dict(restored)  # all ranks' sums: added once, on rank 0
        state.epoch_totals = None
        self.window_start = self.epoch_metrics.totals()
        window_started = time.perf_counter()
        progress = self.reporter.progress(f"epoch {epoch + 1}/{self.options.epochs}", sampler.steps_per_epoch,
                                          done=state.step_in_epoch)
        accum = self.options.grad_accum
        for micro_step, batch in enumerate(self.data.train_loader):
            if micro_step % accum == 0:
                # Seeded per optimizer step (differently per rank): dropout and augmentation
                # draw the same after a resume at any step, and independently across ranks.
                seed_generators(step_seed(self.options.seed, self.runtime.env.rank, state.step), self.runtime.device)
            batch = train_batch_to_device(self.data.train_loader, batch, self.runtime.device)
            is_step_end = (micro_step + 1) % accum == 0
            self._forward_backward(batch, accum, sync=is_step_end, step=state.step + 1)
            if not is_step_end:
                continue
            self._optimizer_step()
            state.step += 1
            if self.profiler is not None:
                self.profiler.step()
            if self.options.detect_anomaly:
                self.loss_watch.check_now()
            state.step_in_epoch += 1
            progress.update()
            if state.step % self.options.log_every_steps == 0:
                self._report_window(state.step, time.perf_counter() - window_started)
                window_started = time.perf_counter()
            if self._should_stop(state):
                progress.close()
                self._save_mid_epoch(state)
                state.stopped_early = True
                return {}
            every = self.options.checkpoint_every_steps
            if every and state.step % every == 0 and state.step_in_epoch < sampler.steps_per_epoch:
                self._save_mid_epoch(state)
        state.step_in_epoch = 0
        progress.close()
        metrics = metrics_of(self.task, self.epoch_metrics.reduce())
        self.loss_watch.check(metrics["loss"])
        # Samples trained (and timed) by this run, not those restored from a checkpoint.
        metrics["timed_count"] = metrics["count"] - (int(restored["count"][0]) if restored is not None else 0)
        return metrics

    def _should_stop(self, state: TrainState) -> bool:
        """max_steps reached, or a rank got SIGTERM or SIGUSR2 (agreed at steps every rank
        computes alike, see src/parallel/preemption.py), so every rank stops at the same step."""
        if self.options.max_steps is not None and state.step >= self.options.max_steps:
            return True
        return self.preemption.stop_requested(state.step)

    def _save_mid_epoch(self, state: TrainState) -> None:
        """A step checkpoint: the model and everything needed to go on from this very step."""
        state.epoch_totals = self.epoch_metrics.state_dict()
        self.loss_watch.check(state.epoch_totals["loss"][0])  # never checkpoint a diverged model
        if self.options.save_checkpoints:
            self.checkpointer.save(self.state_dict(state, self.run_config), is_best=False, step=state.step)
        state.epoch_totals = None
        log.info("checkpoint at step %d (epoch %d, step %d of %d)", state.step, state.epoch + 1,
                 state.step_in_epoch, self.data.train_sampler.steps_per_epoch)

    def _forward_backward(self, batch: Any, accum: int, sync: bool, step: int) -> None:
        args, kwargs, target = self.task.split(batch)
        if self.example_inputs is None:  # shapes for counting FLOPs (src/loop/performance.py), no memory
            self.example_inputs = tree_map(lambda t: torch.empty_like(t, device="meta"), (args, kwargs))
        # On micro-steps before the last one, DDP must not all-reduce gradients yet.
        sync_context: ContextManager[Any] = contextlib.nullcontext()
        if self.ddp is not None and not sync:
            sync_context = self.ddp.no_sync()
        with sync_context:
            with autocast(self.runtime.device, self.amp_dtype):
                outputs = self.train_model(*args, **kwargs)
            loss_sum, count = self.task.loss(outputs, target)
            # Each micro-batch holds 1/accum of the rank's samples; DDP averages over ranks,
            # so the gradient is the mean over the global batch.
            loss = loss_sum / (count * accum)
            self.loss_watch.observe(loss_sum, step)
            try:
                self.scaler.scale(loss).backward()
            except RuntimeError as error:  # anomaly mode names the backward op that made a NaN
                if not self.options.detect_anomaly or "nan values" not in str(error):
                    raise
                what = str(error).splitlines()[0].rstrip(".")
                raise TrainingDiverged(diverged_message(step, what, names_the_op=True)) from None
        self.epoch_metrics.add(self.task.batch_sums(outputs, target, loss_sum, count))

    def _optimizer_step(self) -> None:
        if self.options.grad_clip is not None:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.options.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def evaluate(self) -> dict[str, Any]:
        """The task's metrics (and val tables) over the whole val split, each sample counted once."""
        return evaluate(self.module, self.reporter.track(self.data.val_loader, "val"), self.task,
                        self.data.splits.info, self.runtime.device, self.amp_dtype)

    def summary(self, state: TrainState, num_val_samples: int) -> dict[str, Any]:
        """The run so far, as written to metrics.json: the last epoch's metrics and the history."""
        last = state.history[-1]
        return {
            **{key: value for key, value in last.items() if key.startswith(("train/", "val/"))},
            "epoch": last["epoch"],
            "step": last["step"],
            "val/num_samples": num_val_samples,
            "world_size": self.runtime.world_size,
            "global_batch_size": self.data.train_sampler.global_batch_size,
            "samples_per_s": state.train_samples / state.train_seconds,
            "history": state.history,
        }

    # -- helpers -----------------------------------------------------------------------

    def _improves(self, state: TrainState, value: float) -> bool:
        better = state.best is None or (
            value > state.best if self.options.monitor_mode == "max" else value < state.best
        )
        if better:
            state.best = value
        return better

    def _report_window(self, step: int, seconds: float) -> None:
        window = metrics_of(self.task, self.epoch_metrics.reduce(baseline=self.window_start))
        self.loss_watch.check(window["loss"])
        self.window_start = self.epoch_metrics.totals()
        samples_per_s = window["count"] / seconds
        self.reporter.scalars(
            {
                **metric_values("train", window),
                "lr": self.optimizer.param_groups[0]["lr"],
                "throughput/samples_per_s": samples_per_s,
                **self._utilization.scalars(samples_per_s),  # MFU and peak memory on GPUs of known peak
            },
            step,
        )

    @functools.cached_property
    def _utilization(self) -> Utilization:
        """Built at the first log window (a GPU counts the model's FLOPs then; the CPU nothing, ever)."""
        return Utilization(self.module, self.runtime.device, self.options.precision, self.runtime.world_size,
                           self.example_inputs, self.data.train_sampler.micro_batch_size)

    def _report_epoch(self, record: dict[str, float], num_val: int) -> None:
        self.reporter.scalars(
            {
                **{key.replace("train/", "epoch/train_"): v for key, v in record.items() if key.startswith("train/")},
                **{key: v for key, v in record.items() if key.startswith("val/")},
                "time/epoch_s": record["epoch_time_s"],
                "throughput/epoch_samples_per_s": record["samples_per_s"],
            },
            record["step"],
        )
        log.info("epoch %d/%d  step %d  %s  %s (%d samples)  %.0f samples/s", record["epoch"], self.options.epochs,
                 record["step"], format_metrics(record, "train"), format_metrics(record, "val"), num_val,
                 record["samples_per_s"])


def metric_values(split: str, metrics: dict[str, Any]) -> dict[str, float]:
    """`split/<name>` for each metric the task computed; counts and tables (e.g. the confusion
    matrix) are reported on their own."""
    return {f"{split}/{name}": value for name, value in metrics.items()
            if name not in _NOT_METRICS and isinstance(value, float)}


_NOT_METRICS = ("count", "timed_count")


def format_metrics(record: dict[str, Any], split: str) -> str:
    """`train loss 0.1234 acc 0.9876`: a split's metrics of an epoch record, for the log."""
    values = [f"{key.split('/', 1)[1]} {value:.4f}" for key, value in record.items() if key.startswith(f"{split}/")]
    return f"{split} {' '.join(values)}"


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
