"""The training loop: each epoch's steps (the task's `train_step` over `grad_accum` micro-batches), its evaluation,
record, checkpoint and report; it stops with a checkpoint after `max_steps`, on preemption, or when a callback ends the
run, telling its callbacks (src/loop/callback.py) what it does. Its records name rates and counts by the task's unit
(`samples_per_s`, `val/num_tokens`)."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch
from torch import nn

from src.checkpoint import layout
from src.checkpoint import read as checkpoint_read
from src.checkpoint.states import ModelState, Named, OptimizerState
from src.checkpoint.store import Checkpoint
from src.common.errors import UsageError
from src.common.seeding import seed_generators, step_seed
from src.config.schema import TrainerConfig
from src.data.batches import to_device
from src.loop.callback import Outcome, Run, Step, TrainParts, TrainState
from src.loop.evaluation import Evaluation
from src.loop.performance import autocast_dtype
from src.loop.step import MetricSums, StepContext
from src.loop.task import Task
from src.parallel import fsdp
from src.parallel.job import RunContext
from src.parallel.preemption import Preemption
from src.reports.hparams import changed_settings, run_hparams
from src.reports.images import image_grid
from src.reports.reporting import model_summary

log = logging.getLogger(__name__)


@dataclass
class LogWindow:
    """The optimizer steps since the last train/* scalars: the epoch's sums, the step and the clock when it began."""

    totals: torch.Tensor
    step: int
    started: float = field(default_factory=time.perf_counter)


class Trainer:
    """Runs `fit()` on every rank; all ranks execute the same collectives in the same order."""

    def __init__(self, config: TrainerConfig, parts: TrainParts) -> None:
        self.config, self.parts = config, parts
        device = parts.runtime.device
        self.amp_dtype = autocast_dtype(config.precision)
        # fp16 needs loss scaling to keep small gradients from flushing to zero; bf16 does not.
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.amp_dtype == torch.float16)
        self.preemption = Preemption(device, config.log_every_steps)  # SIGTERM / SIGUSR2 caught while fit() runs
        self.epoch_metrics = MetricSums(parts.task.sum_shapes(parts.data.splits.info), device)
        self._val_count: int | None = None  # the last val pass's units (metrics.json's val/num_<unit>)
        self.step = StepContext(parts.train_models, parts.modules, parts.optimizers, parts.task.aux, self.scaler,
                                self.epoch_metrics, device, self.amp_dtype, parts.runtime.env.rank,
                                parts.runtime.world_size, parts.data.train_sampler.micro_batch_size, parts.seed,
                                config.grad_clip, parts.callbacks.before_optimizer_step)

    def stateful(self, state: TrainState) -> dict[str, Any]:
        """The parts a checkpoint saves and a resume restores, by name (src/checkpoint/store.py)."""
        parts = self.parts
        return {"models": Named({name: ModelState(module, name) for name, module in parts.modules.items()}, "model"),
                "optimizers": Named({name: OptimizerState(parts.modules[name], optimizer)
                                     for name, optimizer in parts.optimizers.items()}, "optimizer"),
                "schedulers": Named(parts.schedulers, "schedule"), "scaler": self.scaler, "loop": state,
                "callbacks": parts.callbacks, "config": parts.saved_config, "output_model": parts.task.output_model}

    def restore(self, state: TrainState, checkpoint: Checkpoint) -> None:
        """Every part but the callbacks' (`fit` restores theirs) from `checkpoint`, before the run writes anything."""
        checkpoint.restore({name: part for name, part in self.stateful(state).items() if name != "callbacks"})
        log.info("resumed from %s after epoch %d, step %d (%d steps into epoch %d)", checkpoint.path, state.epoch,
                 state.step, state.step_in_epoch, state.epoch + 1)
        saved, batch = (checkpoint.config or {}).get("dataset", {}).get("batch_size"), self.parts.data.train_sampler
        if state.step_in_epoch and saved not in (None, batch.global_batch_size):  # the epoch's place counts its steps
            raise UsageError(f"dataset.batch_size={batch.global_batch_size} cannot resume a run stopped "
                             f"{state.step_in_epoch} steps into epoch {state.epoch + 1} at dataset.batch_size={saved} "
                             f"(its place in the epoch is counted in steps): resume with dataset.batch_size={saved}")
        changed = changed_settings(checkpoint.config or {}, self.parts.saved_config)
        if changed and self.parts.runtime.is_main_process:  # the same on every rank: said once
            log.warning("resumed with settings its run did not have: %s", "; ".join(changed))

    def fit(self, state: TrainState, checkpoint: Checkpoint | None = None) -> Outcome:
        """Train from `state` (in place; restored from `checkpoint`) to `config.epochs`, then test; how it ended."""
        self.parts.reporter.text("model/summary", model_summary(self.parts.modules))
        if state.ended is not None:
            log.info("%s after epoch %d: nothing more to train", state.ended.ended_by, state.ended.epoch)
            return Outcome.ENDED
        run = Run(self.config, self.parts, state, checkpoint is not None, self.evaluate)
        callbacks = self.parts.callbacks
        try:
            callbacks.run_start(run)
            if checkpoint is not None:  # the callbacks' state, once they hold the run's parts
                checkpoint.restore({"callbacks": callbacks})
            with self.preemption:
                outcome = self._epochs(run)
            self.parts.store.wait()  # the last checkpoint written (trainer.async_checkpoint), or its failure raised
            if outcome is not Outcome.PREEMPTED:  # training is over (a preempted run goes on elsewhere)
                self._final_test(run, outcome)
                self.parts.store.wait()
        except Exception as error:
            self.parts.store.wait_after_failure()  # a background write ends before the group is torn down
            callbacks.exception(run, error)  # a callback may raise a clearer error in its place
            raise
        finally:
            self.parts.data.close()
        callbacks.run_end(run, outcome)
        return outcome

    def _epochs(self, run: Run) -> Outcome:
        if self.config.max_steps is not None and run.state.step >= self.config.max_steps:
            return Outcome.MAX_STEPS  # resumed at the limit: not one step past it
        for epoch in range(run.state.epoch, self.config.epochs):
            started = time.perf_counter()
            train = self.train_one_epoch(epoch, run)
            if isinstance(train, Outcome):
                return train
            if self._end_epoch(epoch, run, train, started):
                return Outcome.ENDED
        return Outcome.COMPLETED

    def train_one_epoch(self, epoch: int, run: Run) -> dict[str, float] | Outcome:
        """One epoch's steps from `state.step_in_epoch` on: its train metrics, or why the run stopped before its end."""
        state = run.state
        restored = self._start_epoch(epoch, state)
        window = LogWindow(self.epoch_metrics.totals(), state.step)
        progress = self.parts.reporter.progress(f"epoch {epoch + 1}/{self.config.epochs}",
                                                self.parts.data.train_sampler.steps_per_epoch, done=state.step_in_epoch)
        batches = iter(self.parts.data.train_loader)  # the sampler gives whole steps: grad_accum micro-batches each
        while micro_batches := list(itertools.islice(batches, self.config.grad_accum)):
            self._train_step(micro_batches, state)
            progress.update()
            if (interrupted := self._after_step(run, window)) is not None:
                progress.close()
                self._save_mid_epoch(run)
                return interrupted
        state.step_in_epoch = 0
        progress.close()
        metrics = metrics_of(self.parts.task, self.epoch_metrics.reduce())
        # timed_count: the units this run trained, not those a step checkpoint restored
        metrics["timed_count"] = metrics["count"] - (int(restored["count"][0]) if restored is not None else 0)
        return metrics

    def evaluate(self, desc: str = "val", split: str = "val") -> dict[str, Any]:
        """The task's metrics of the models as they are now over the whole `split` (`desc`: the progress bar's)."""
        parts = self.parts
        return evaluate(parts.task, parts.modules, parts.data.loader, parts.data.splits.info, parts.runtime.device,
                        self.amp_dtype, parts.seed, lambda batches, _: parts.reporter.track(batches, desc), split)

    def summary(self, state: TrainState, num_val_samples: int) -> dict[str, Any]:
        """The run so far, as written to metrics.json."""
        summary = run_summary(state.history, num_val_samples, self.parts.runtime.world_size,
                              self.parts.data.train_sampler.global_batch_size,
                              state.train_samples / state.train_seconds, self.parts.task.unit)
        summary["frozen_parameters"] = sum(p.numel() for module in self.parts.modules.values()
                                           for p in module.parameters() if not p.requires_grad)
        if state.ended is not None:
            summary.update(stop_reason=state.ended.reason, stopped_at_epoch=state.ended.epoch)
        if state.test is not None:
            summary.update(state.test["metrics"], tested_weights=state.test["weights"])
        return summary

    def report(self, state: TrainState, outcome: Outcome, context: RunContext) -> float:
        """Close the run's reports; returns the monitored metric's last value (NaN without one)."""
        reporter, monitor = self.parts.reporter, self.config.monitor
        if not outcome.is_final:  # with the run's own arguments (a higher max_steps, if any, is the user's choice)
            again = context.resume_args("trainer.max_steps=") if outcome is Outcome.MAX_STEPS else context.resume_args()
            log.info("stopped at step %d with a checkpoint; continue with: %s", state.step, again)
            reporter.close()  # the trackers' runs KILLED until the run continues
            return state.history[-1].get(monitor, float("nan")) if state.history and monitor else float("nan")
        summary = self.summary(state, self.parts.data.num_val_samples)
        final = {k: v for k, v in summary.items() if "/" in k and "/num_" not in k}
        reporter.hparams(run_hparams(self.parts.saved_config, context.overrides, context.choices,
                                     self.parts.data.train_sampler.global_batch_size), final)
        reporter.close()
        log.info("final: %s", "  ".join(f"{k}={v:.4f}" for k, v in final.items()))
        log.info("run dir: %s", reporter.run_dir)
        return summary.get(monitor, float("nan")) if monitor else float("nan")

    def _final_test(self, run: Run, outcome: Outcome) -> None:
        """Test the chosen weights (best.pt's, or the last) once, put the last back and checkpoint the result."""
        parts, state = self.parts, run.state
        if not self.config.test or parts.data.splits.test is None:
            if self.config.test and state.test is None:
                log.info("the dataset has no test split: the run ends without a test (a test/ folder beside train/ "
                         "gives one to dataset=image_folder, DataSplits(test=...) to a builder of yours)")
            return
        if state.test is not None and state.test["step"] == state.step:
            return  # tested already: a resumed run that had nothing more to train
        chosen, weights = self._chosen_weights(state)
        weights_parts = {name: part for name, part in self.stateful(state).items() if name in ("models", "callbacks")}
        if chosen is not None:
            chosen.restore(weights_parts)
        test = self.evaluate("test", split="test")
        scores = {**metric_values("test", test), **parts.callbacks.test(run, test)}
        state.test = {"step": state.step, "weights": weights,
                      "metrics": {**scores, f"test/num_{parts.task.unit}": test["count"]}}
        if chosen is not None:  # the last weights back, before they are saved again
            checkpoint_read(layout.latest(parts.store.directory)).restore(weights_parts)
        splits = dict.fromkeys(key.split("/")[0] for key in scores)
        log.info("%s (%d %s; weights: %s)", "  ".join(format_metrics(scores, split) for split in splits),
                 test["count"], parts.task.unit, weights)
        parts.reporter.scalars(state.test["metrics"], state.step)
        if outcome is Outcome.MAX_STEPS:
            self._save_mid_epoch(run)
        else:
            self._checkpoint(run, is_best=False)
        if state.history:
            parts.reporter.write_metrics(self.summary(state, self._val_count or parts.data.num_val_samples))

    def _chosen_weights(self, state: TrainState) -> tuple[Checkpoint | None, str]:
        """The checkpoint of the weights to test (None: the last, which the model holds), and what they are."""
        best = layout.best(self.parts.store.directory)
        if self.config.monitor is None or best is None:
            return None, f"the last, of step {state.step}"
        step = (chosen := checkpoint_read(best)).loop.get("step")
        return (None if step == state.step else chosen), f"{best.name}, of step {step} (best {self.config.monitor})"

    def _start_epoch(self, epoch: int, state: TrainState) -> dict[str, list[float]] | None:
        """Point the sampler at the epoch (and step), and start its sums: zero, or a step checkpoint's (returned)."""
        self.parts.data.train_sampler.set_epoch(epoch, start_step=state.step_in_epoch)
        for model in self.parts.train_models.values():
            model.train()
        self.epoch_metrics.reset()
        if (restored := state.epoch_totals) is not None and self.parts.runtime.is_main_process:
            self.epoch_metrics.load_state_dict(restored)  # a resumed epoch's first steps: all ranks' sums, added once
        state.epoch_totals = None
        return restored

    def _after_step(self, run: Run, window: LogWindow) -> Outcome | None:
        """After a step: the window's scalars, then why to stop (the caller checkpoints), or a due step checkpoint."""
        step = run.state.step
        if step % self.config.log_every_steps == 0:
            self._report_window(step, window)
        if self.config.max_steps is not None and step >= self.config.max_steps:
            return Outcome.MAX_STEPS
        if self.preemption.stop_requested(step):  # agreed by every rank, at the same step
            return Outcome.PREEMPTED
        every = self.config.checkpoint_every_steps
        if every and step % every == 0 and run.state.step_in_epoch < self.parts.data.train_sampler.steps_per_epoch:
            self._save_mid_epoch(run)
        return None

    def _end_epoch(self, epoch: int, run: Run, train: dict[str, float], started: float) -> bool:
        """Evaluate, record, ask the callbacks whether to stop (the checkpoint holds it), report, checkpoint."""
        state, parts = run.state, self.parts
        train_seconds = time.perf_counter() - started
        for name in [name for name in parts.optimizers if name not in self.step.stepped]:  # said once
            log.warning("model %s took no optimizer step in epoch %d: train_step never called "
                        "step.optimizer_step(%r), so it does not train (its schedule steps all the same)",
                        name, epoch + 1, name)
            self.step.stepped.add(name)
        val = self.evaluate()
        self._val_count = val["count"]
        images = val.pop("images", {})  # a task's samples (a GAN's), shown as grids
        extra = parts.callbacks.validation(run, val)  # e.g. val_ema/*
        state.epoch = epoch + 1
        state.train_samples += train["timed_count"]
        state.train_seconds += train_seconds
        record = epoch_record(state.epoch, state.step, train, val, self._lr(), time.perf_counter() - started,
                              train_seconds, extra, parts.task.unit)
        state.history.append(record)
        is_best = self.config.monitor is not None and self._improves(state, record[self.config.monitor])
        end = parts.callbacks.epoch_end(run, record)  # the same on every rank
        if end is not None:
            state.ended = replace(end, epoch=state.epoch)
            log.info("%s", end.message)
        parts.reporter.scalars(epoch_scalars(record, parts.task.unit), record["step"])
        for tag, batch in images.items():
            parts.reporter.image(f"val/{tag}", image_grid(batch), record["step"])
        log.info("%s", epoch_line(record, self.config.epochs, val["count"], parts.task.unit))
        self._checkpoint(run, is_best)
        # After the checkpoint: metrics.json never reports an epoch a restart would lose.
        parts.reporter.write_metrics(self.summary(state, val["count"]))
        return end is not None

    def _train_step(self, micro_batches: list[Any], state: TrainState) -> None:
        """The task's `train_step` over the step's micro-batches, then the schedules, the fp16 scaler and the count."""
        parts, step = self.parts, self.step
        # Seeded per step and rank: dropout draws the same after a resume at any step, and independently per rank.
        seed_generators(step_seed(parts.seed, parts.runtime.env.rank, state.step), parts.runtime.device)
        step.begin([to_device(batch, parts.runtime.device) for batch in micro_batches], state.step + 1)
        try:
            parts.task.train_step(step)
        except RuntimeError as error:  # DDP's failure when a model's parameters got no gradient: one line
            if "find_unused_parameters" not in str(error):
                raise
            raise UsageError("a model's parameters got no gradient in a training step, so DDP could not all-reduce "
                             "them (a layer the forward skips, a loss that ignores an output): set "
                             "dist.find_unused_parameters=true, or freeze those parameters (trainer.freeze)")
        if step.first:
            if not step.updated:
                raise UsageError(f"{type(parts.task).__name__}.train_step updated no model: call "
                                 "step.optimizer_step(NAME) for each model it trains")
            if step.loss is None:  # loss.backward() called: no share of the global mean, no NaN watch
                raise UsageError(f"{type(parts.task).__name__}.train_step back-propagated no loss through "
                                 "step.backward(loss_sum, step.divisor(counts)): call it instead of loss.backward()")
            if not step.counted:  # the train metrics would be NaN, the samples/s 0
                raise UsageError(f"{type(parts.task).__name__}.train_step added no count: give step.add_sums the "
                                 "units its losses sum over, {'count': N, ...}: every metric divides by it")
            parts.runtime.first_step_taken()  # collectives wait dist.step_timeout_s from now on
            step.first = False
        self.scaler.update()
        for scheduler in parts.schedulers.values():
            scheduler.step()
        state.step += 1
        state.step_in_epoch += 1
        parts.callbacks.step_end(Step(state.step, step.loss, step.inputs))

    def _checkpoint(self, run: Run, is_best: bool, mid_epoch: bool = False) -> None:
        """Save the run's parts, once every callback accepts the state (the NaN watch refuses a diverged one)."""
        self.parts.callbacks.checkpoint(run)
        if self.config.save_checkpoints:
            self.parts.store.save(self.stateful(run.state), run.state.step, is_best, mid_epoch)

    def _save_mid_epoch(self, run: Run) -> None:
        """A step checkpoint: everything needed to go on from this very step."""
        state = run.state
        state.epoch_totals = self.epoch_metrics.state_dict()
        self._checkpoint(run, is_best=False, mid_epoch=True)
        state.epoch_totals = None
        log.info("checkpoint at step %d (epoch %d, step %d of %d)", state.step, state.epoch + 1,
                 state.step_in_epoch, self.parts.data.train_sampler.steps_per_epoch)

    def _lr(self) -> float:
        """The learning rate of the output model's optimizer (its first parameter group)."""
        optimizers = self.parts.optimizers
        return optimizers.get(self.parts.task.output_model, next(iter(optimizers.values()))).param_groups[0]["lr"]

    def _improves(self, state: TrainState, value: float) -> bool:
        better = state.best is None or (value > state.best if self.config.monitor_mode == "max" else value < state.best)
        if better:
            state.best = value
        return better

    def _report_window(self, step: int, window: LogWindow) -> None:
        seconds = time.perf_counter() - window.started
        metrics = metrics_of(self.parts.task, self.epoch_metrics.reduce(baseline=window.totals))
        window.totals = self.epoch_metrics.totals()
        unit = self.parts.task.unit
        scalars = {**metric_values("train", metrics), "lr": self._lr(),
                   f"throughput/{rate_name(unit)}": metrics["count"] / seconds}
        if unit != "samples":  # also in samples, MFU's unit
            samples = (step - window.step) * self.parts.data.train_sampler.global_batch_size
            scalars["throughput/samples_per_s"] = samples / seconds
        scalars.update(self.parts.callbacks.log(step, scalars))  # the NaN watch looks at train/loss here
        self.parts.reporter.scalars(scalars, step)
        window.started, window.step = time.perf_counter(), step


def evaluate(task: Task, models: Mapping[str, nn.Module], loaders: Callable[[str], tuple[Iterable[Any], int]],
             info: Mapping[str, Any], device: torch.device, amp_dtype: torch.dtype | None = None, seed: int = 0,
             track: Callable[[Iterable[Any], str], Iterable[Any]] = lambda batches, _: batches,
             split: str = "val") -> dict[str, Any]:
    """The task's metrics (tables, `images`, `count` of units) of the unwrapped `models` (ranks may run different
    numbers of batches, which DDP would not allow) on `split`, over all ranks. A collective."""
    sums = MetricSums({**task.sum_shapes(info), **task.val_sum_shapes(info)}, device)
    evaluation = Evaluation(models, task.aux, loaders, sums, device, amp_dtype, seed, track, split)
    modes = {name: model.training for name, model in models.items()}
    for model in models.values():
        model.eval()
    with torch.no_grad():
        task.evaluate(evaluation)
    for name, model in models.items():
        model.train(modes[name])
        fsdp.reshard(model)  # the next forward gathers the shards as they are then
    return {**metrics_of(task, sums.reduce()), **({"images": evaluation.images} if evaluation.images else {})}


def metrics_of(task: Task, sums: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    return {**task.compute(sums), "count": int(sums["count"])}


def rate_name(unit: str) -> str:
    return f"{unit}_per_s"


def metric_values(split: str, metrics: dict[str, Any]) -> dict[str, float]:
    """`split/<name>` for each metric the task computed; counts and tables are reported on their own."""
    return {f"{split}/{name}": value for name, value in metrics.items()
            if name not in ("count", "timed_count") and isinstance(value, float)}


def format_metrics(record: dict[str, Any], split: str) -> str:
    """`train loss 0.1234 acc 0.9876`: a split's metrics of an epoch record, for the log."""
    values = [f"{key.split('/', 1)[1]} {value:.4f}" for key, value in record.items() if key.startswith(f"{split}/")]
    return f"{split} {' '.join(values)}"


def epoch_record(epoch: int, step: int, train: dict[str, Any], val: dict[str, Any], lr: float,
                 epoch_seconds: float, train_seconds: float, extra: dict[str, float] | None = None,
                 unit: str = "samples") -> dict[str, float]:
    """One entry of the run's history: train, val and the callbacks' `extra` metrics, lr, time and throughput."""
    return {"epoch": epoch, "step": step, **metric_values("train", train), **metric_values("val", val), **(extra or {}),
            "lr": lr, "epoch_time_s": epoch_seconds, rate_name(unit): train["timed_count"] / train_seconds}


def epoch_scalars(record: dict[str, float], unit: str = "samples") -> dict[str, float]:
    return {**{key.replace("train/", "epoch/train_"): v for key, v in record.items() if key.startswith("train/")},
            **{key: v for key, v in record.items() if "/" in key and not key.startswith("train/")},
            "time/epoch_s": record["epoch_time_s"], f"throughput/epoch_{rate_name(unit)}": record[rate_name(unit)]}


def epoch_line(record: dict[str, float], epochs: int, num_val: int, unit: str = "samples") -> str:
    """`epoch 3/20  step 84  train loss ...  val loss ... val_ema loss ... (359 samples)  5120 samples/s`."""
    splits = dict.fromkeys(key.split("/", 1)[0] for key in record if "/" in key and not key.startswith("train/"))
    val = "  ".join(format_metrics(record, split) for split in splits)
    return "epoch %d/%d  step %d  %s  %s (%d %s)  %.0f %s/s" % (
        record["epoch"], epochs, record["step"], format_metrics(record, "train"), val, num_val, unit,
        record[rate_name(unit)], unit)


def run_summary(history: list[dict[str, float]], num_val: int, world_size: int, global_batch_size: int,
                per_s: float, unit: str = "samples") -> dict[str, Any]:
    """metrics.json: the last epoch's metrics, the history, the val units covered, the training throughput."""
    last = history[-1]
    return {**{key: value for key, value in last.items() if "/" in key}, "epoch": last["epoch"], "step": last["step"],
            f"val/num_{unit}": num_val, "world_size": world_size, "global_batch_size": global_batch_size,
            rate_name(unit): per_s, "history": history}
