"""What a run leaves behind for people, all through the `Reporter`: log files (rank 0's `train.log`, others'
`train.rank<R>.log`), progress bars, TensorBoard events, metrics.json, the run dir's files, the trackers."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol, Sequence, TypeVar

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams as hparams_summary
from tqdm import tqdm

from src.common.files import write_text_atomically

_FORMAT = "[%(asctime)s][%(levelname)s] %(message)s"
T = TypeVar("T")


def setup_logging(run_dir: Path, rank: int, name: str = "train") -> None:
    """Send this rank's log records to `<name>.log` or `<name>.rank<R>.log` in the run dir, and to the console."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.INFO)
    filename = f"{name}.log" if rank == 0 else f"{name}.rank{rank}.log"
    console = _ConsoleHandler(sys.stdout if rank == 0 else sys.stderr)
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    console.addFilter(lambda record: getattr(record, "console", True))
    for handler in (logging.FileHandler(run_dir / filename), console):
        handler.setFormatter(logging.Formatter(_FORMAT if rank == 0 else f"[rank {rank}]{_FORMAT}"))
        root.addHandler(handler)


class _ConsoleHandler(logging.StreamHandler):
    """Prints each record above a progress bar on the same console, not glued to the end of the bar's line."""

    def emit(self, record: logging.LogRecord) -> None:
        with tqdm.external_write_mode(file=self.stream):
            super().emit(record)


def log_run_start(run_dir: Path, runtime: Any, modules: Mapping[str, nn.Module], data: Any, grad_accum: int,
                  config: Mapping[str, Any], overrides: Sequence[str] = (), print_config: bool = False,
                  unit: str = "samples") -> None:
    """Log the overrides, the resolved config and a one-line summary of the run; `unit`: what metrics average over."""
    log = logging.getLogger("train")
    log.info("overrides: %s", " ".join(overrides) or "none (the defaults of conf/config.yaml)")
    log.info("config:\n%s", OmegaConf.to_yaml(config).rstrip(), extra={"console": print_config})
    sampler = data.train_sampler
    models = []
    for name, module in modules.items():
        total, trainable = parameter_counts(module)
        frozen = f", {total - trainable:,} frozen" if total > trainable else ""  # trainer.freeze
        named = "" if list(modules) == ["model"] else f"{name}: "
        models.append(f"{named}{type(module).__name__} ({total:,} parameters, {trainable:,} trainable{frozen})")
    trainer, test = config["trainer"], getattr(data.splits, "test", None)
    sizes = f"{len(data.splits.train)} train / {len(data.splits.val)} val"
    sizes += f" / {len(test)} test samples" if test is not None else " samples, no test split"
    best = f"best.pt by {trainer['monitor']}, {trainer['monitor_mode']}" if trainer["monitor"] else (
        "no best.pt: trainer.monitor=null")
    log.info("run dir %s | world size %d | device %s | backend %s | task %s (%s), metrics per %s | model %s | "
             "%s | global batch %d = %d ranks x %d per rank x %d accum | %d steps/epoch",
             run_dir, runtime.world_size, runtime.device, runtime.backend or "none (single process)",
             config["task"]["_target_"].rsplit(".", 1)[-1], best, unit.removesuffix("s"), ", ".join(models),
             sizes, sampler.global_batch_size, runtime.world_size, sampler.micro_batch_size,
             grad_accum, sampler.steps_per_epoch)


def parameter_counts(module: nn.Module) -> tuple[int, int]:
    """(all, trainable) parameter elements of `module`; a parameter shared by two layers counts once."""
    parameters = list(module.parameters())
    return sum(p.numel() for p in parameters), sum(p.numel() for p in parameters if p.requires_grad)


def model_summary(modules: Mapping[str, nn.Module]) -> str:
    """Markdown: for each model, its parameters per top-level child and in all, then the module tree."""
    parts = []
    for model, module in modules.items():
        rows = [f"### {model}\n" if len(modules) > 1 else "", "| module | type | parameters |", "|---|---|---:|"]
        for name, child in module.named_children():
            rows.append(f"| {name} | {type(child).__name__} | {parameter_counts(child)[0]:,} |")
        total, trainable = parameter_counts(module)
        rows.append(f"| **total** | {type(module).__name__} | {total:,} ({trainable:,} trainable) |")
        tree = "\n".join(f"    {line}" for line in repr(module).splitlines())  # indented: a code block
        parts.append("\n".join(row for row in rows if row) + "\n\n" + tree)
    return "\n\n".join(parts)


class Trackers(Protocol):
    """What the reporter hands the run's trackers (src/reports/tracking.py: a callback of the loop's, above this)."""

    def log(self, scalars: Mapping[str, float], step: int) -> None: ...
    def log_final(self, final_metrics: Mapping[str, float]) -> None: ...
    def close(self) -> None: ...


class Reporter:
    """Progress bars, TensorBoard events, metrics.json, the run dir's files and the `trackers`, from the main process
    only. The `tb/` dir is made by the first event, so a run refused before any leaves none."""

    def __init__(self, run_dir: Path, is_main_process: bool, tensorboard: bool = True, progress: bool = False,
                 trackers: Trackers | None = None) -> None:
        self.run_dir, self.is_main_process = run_dir, is_main_process
        self._tensorboard = is_main_process and tensorboard
        self._trackers = trackers if is_main_process else None
        self._writer: Any = None
        # Bars on the main process's terminal only: in a log file, tqdm's carriage-return redraws are noise.
        self._console = sys.stdout if progress and is_main_process and sys.stdout.isatty() else None
        self._bar = tqdm(disable=True)  # no bar before progress() makes one

    def progress(self, desc: str, total: int, done: int = 0) -> tqdm:
        """A bar of `total` steps, `done` already (disabled without a console), gone when closed; shows `train/loss`."""
        self._bar = tqdm(total=total, initial=done, desc=desc, unit="step", file=self._console, leave=False,
                         dynamic_ncols=True, disable=self._console is None)
        return self._bar

    def track(self, iterable: Iterable[T], desc: str) -> Iterable[T]:
        """`iterable` counted by a bar as it is consumed; `iterable` itself when no bar is drawn."""
        return iterable if self._console is None else tqdm(iterable, desc=desc, unit="batch", file=self._console,
                                                            leave=False, dynamic_ncols=True)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        if "train/loss" in values:
            self._bar.set_postfix(loss=f"{values['train/loss']:.4f}", refresh=False)
        if self._tensorboard:
            for tag, value in values.items():
                self._events().add_scalar(tag, value, global_step=step)
        if self._trackers is not None:
            self._trackers.log(values, step)

    def _events(self) -> Any:
        """The run's TensorBoard writer, made (with `tb/`) on first use; only where `_tensorboard` is set."""
        if self._writer is None:
            self._writer = SummaryWriter(log_dir=str(self.run_dir / "tb"))
        return self._writer

    @property
    def shows_images(self) -> bool:
        """Whether `image()` writes anything (rank 0 with TensorBoard): callbacks skip drawing otherwise."""
        return self._tensorboard

    def image(self, tag: str, image: torch.Tensor, step: int) -> None:
        if self._tensorboard:
            self._events().add_image(tag, image, global_step=step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self._tensorboard:
            self._events().add_text(tag, text, global_step=step)

    def file(self, name: str, text: str) -> None:
        """A file of the run dir, replaced atomically (a reader never sees half a file)."""
        if self.is_main_process:
            write_text_atomically(self.run_dir / name, text)

    def hparams(self, hparams: Mapping[str, Any], final_metrics: Mapping[str, float]) -> None:
        """The run's hyperparameters with its final metrics, in its own event file; the trackers get the metrics."""
        if self._trackers is not None:
            self._trackers.log_final(final_metrics)
        if not self._tensorboard:
            return
        metrics = {f"hparam/{k}": v for k, v in final_metrics.items() if math.isfinite(v)}
        file_writer = self._events()._get_file_writer()
        for summary in hparams_summary(dict(hparams), metrics):  # the experiment, the session's start and end
            file_writer.add_summary(summary)
        for tag, value in metrics.items():
            self._events().add_scalar(tag, value)

    def write_metrics(self, summary: Mapping[str, Any]) -> None:
        self.file("metrics.json", json.dumps(summary, indent=2) + "\n")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._trackers is not None:
            self._trackers.close()
