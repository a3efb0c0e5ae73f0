"""What a run leaves behind for people: log files, progress bars, TensorBoard events,
metrics.json and confusion_matrix.csv.

Rank 0 prints INFO to the console and writes `train.log` (`eval.log` for eval.py),
TensorBoard events (`tb/`), `metrics.json` and `confusion_matrix.csv`, and draws the
progress bars; every other rank writes its own `train.rank<R>.log` and prints only
warnings, so a crash on any rank is still visible.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, TypeVar

import torch
from omegaconf import OmegaConf
from torch import nn
from tqdm import tqdm

from src.common.files import write_text_atomically
from src.reports.progress import progress_bar, shows_progress, track

_FORMAT = "[%(asctime)s][%(levelname)s] %(message)s"
# Colour of a confusion-matrix cell: white for none of a true class's samples, dark blue for all of them.
EMPTY_CELL_RGB = (1.0, 1.0, 1.0)
FULL_CELL_RGB = (0.03, 0.19, 0.42)
GRID_RGB_VALUE = 0.6  # grey lines between the cells
T = TypeVar("T")


def setup_logging(run_dir: Path, rank: int, name: str = "train") -> None:
    """Send this rank's log records to its file in the run dir, `<name>.log` or
    `<name>.rank<R>.log` (and rank 0's to stdout)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.INFO)
    filename = f"{name}.log" if rank == 0 else f"{name}.rank{rank}.log"
    handlers: list[logging.Handler] = [logging.FileHandler(run_dir / filename)]
    console = _ConsoleHandler(sys.stdout if rank == 0 else sys.stderr)
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    handlers.append(console)
    for handler in handlers:
        handler.setFormatter(logging.Formatter(_FORMAT if rank == 0 else f"[rank {rank}]{_FORMAT}"))
        root.addHandler(handler)


class _ConsoleHandler(logging.StreamHandler):
    """Prints each record above a progress bar on the same console (tqdm clears the bar and draws
    it again below), not glued to the end of the bar's line."""

    def emit(self, record: logging.LogRecord) -> None:
        with tqdm.external_write_mode(file=self.stream):
            super().emit(record)


def log_run_start(
    run_dir: Path, runtime: Any, module: nn.Module, data: Any, grad_accum: int, config: Mapping[str, Any],
    unit: str = "samples",
) -> None:
    """What is about to run: the resolved config as YAML, then a one-line summary (logged by
    every rank, printed once: by rank 0); `unit`: what the task's loss and metrics are averaged over."""
    log = logging.getLogger("train")
    log.info("config:\n%s", OmegaConf.to_yaml(config).rstrip())
    sampler = data.train_sampler
    total, trainable = parameter_counts(module)
    frozen = f", {total - trainable:,} frozen" if total > trainable else ""  # trainer.freeze
    log.info(
        "run dir %s | world size %d | device %s | backend %s | task %s (best.pt by %s, %s), metrics per %s | "
        "model %s (%s parameters, %s trainable%s) | "
        "%d train / %d val samples | global batch %d = %d ranks x %d per rank x %d accum | %d steps/epoch",
        run_dir, runtime.world_size, runtime.device, runtime.backend or "none (single process)",
        config["task"]["_target_"].rsplit(".", 1)[-1], config["trainer"]["monitor"], config["trainer"]["monitor_mode"],
        unit.removesuffix("s"),
        type(module).__name__, f"{total:,}", f"{trainable:,}", frozen,
        len(data.splits.train), len(data.splits.val), sampler.global_batch_size, runtime.world_size,
        sampler.micro_batch_size, grad_accum, sampler.steps_per_epoch,
    )


def parameter_counts(module: nn.Module) -> tuple[int, int]:
    """(all, trainable) parameter elements of `module`; a parameter shared by two layers counts once."""
    parameters = list(module.parameters())
    return sum(p.numel() for p in parameters), sum(p.numel() for p in parameters if p.requires_grad)


def model_summary(module: nn.Module) -> str:
    """Markdown (TensorBoard's text tab): a table of parameters per top-level child and in all,
    then the module tree."""
    rows = ["| module | type | parameters |", "|---|---|---:|"]
    for name, child in module.named_children():
        rows.append(f"| {name} | {type(child).__name__} | {parameter_counts(child)[0]:,} |")
    total, trainable = parameter_counts(module)
    rows.append(f"| **total** | {type(module).__name__} | {total:,} ({trainable:,} trainable) |")
    tree = "\n".join(f"    {line}" for line in repr(module).splitlines())  # indented: a code block
    return "\n".join(rows) + "\n\n" + tree


def image_grid(images: torch.Tensor, min_side: int = 32) -> torch.Tensor:
    """A (3, H, W) grid in [0, 1] of `images` (N, C, H, W), eight to a row.

    Each image is min-max scaled on its own, since normalised inputs are not in [0, 1], and
    enlarged by a whole factor to at least `min_side` pixels (8x8 digits are specks otherwise).
    """
    factor = -(-min_side // min(images.shape[-2:]))
    images = images.float().repeat_interleave(factor, dim=-2).repeat_interleave(factor, dim=-1)
    low = images.amin(dim=(1, 2, 3), keepdim=True)
    high = images.amax(dim=(1, 2, 3), keepdim=True)
    return tile((images - low) / (high - low).clamp(min=1e-5), columns=8, padding=2, pad_value=1.0)


def confusion_heatmap(counts: torch.Tensor, max_side: int = 512) -> torch.Tensor:
    """A (3, H, W) image in [0, 1] of a C x C confusion matrix (rows: true class, top to bottom;
    columns: predicted class, left to right).

    Rows are normalised, so a cell's colour is the share of that true class predicted as that
    class, from EMPTY_CELL_RGB (none) to FULL_CELL_RGB (all): a good model shows a dark
    diagonal whatever the class sizes. Cells are squares of up to 32 pixels (the image at most
    about `max_side` pixels wide), separated by 1-pixel grey lines.
    """
    classes = counts.shape[0]
    shares = counts.double() / counts.sum(dim=1, keepdim=True).clamp(min=1)  # a class never seen: all white
    empty, full = torch.tensor(EMPTY_CELL_RGB), torch.tensor(FULL_CELL_RGB)
    colours = empty + shares.float().unsqueeze(-1) * (full - empty)  # (C, C, 3)
    side = max(1, min(32, max_side // classes))
    cells = colours.view(classes * classes, 3, 1, 1).expand(-1, -1, side, side)
    return tile(cells, columns=classes, padding=1, pad_value=GRID_RGB_VALUE)


def tile(images: torch.Tensor, columns: int, padding: int, pad_value: float) -> torch.Tensor:
    """(N, C, H, W) images, C = 1 or 3, as one RGB (3, H', W') grid of `columns` per row, with
    `padding` pixels of `pad_value` around each: torchvision's make_grid (the unit tests check that it
    is), without importing torchvision, which costs every run 0.85-0.95 s on a 2-core CPU box (measured)."""
    count, _, height, width = images.shape
    columns = min(columns, count)
    rows = -(-count // columns)
    grid = images.new_full((3, rows * (height + padding) + padding, columns * (width + padding) + padding), pad_value)
    for index, image in enumerate(images):
        row, column = divmod(index, columns)
        top, left = padding + row * (height + padding), padding + column * (width + padding)
        grid[:, top : top + height, left : left + width] = image  # a grey image broadcasts to RGB
    return grid


def confusion_csv(counts: torch.Tensor) -> str:
    """The matrix as CSV: a header of predicted classes, then one row per true class with its raw counts."""
    classes = range(counts.shape[0])
    lines = ["true\\predicted," + ",".join(map(str, classes))]
    lines += [f"{true}," + ",".join(str(n) for n in row) for true, row in zip(classes, counts.tolist())]
    return "\n".join(lines) + "\n"


def _first_input(task: Any, sample: Any) -> Any:
    """The first model input of one sample (its first positional input, else its first keyword one)."""
    args, kwargs, _ = task.split(sample)
    return args[0] if args else next(iter(kwargs.values()), None)


class Reporter:
    """Progress bars, TensorBoard events, metrics.json and confusion_matrix.csv, from the main
    process only: on other ranks every method does nothing.

    With `tensorboard=False` it writes the files alone (no `tb/` dir, no TensorBoard import).
    With `progress=True` it draws progress bars when stdout is a terminal (`trainer.progress`).
    """

    def __init__(self, run_dir: Path, is_main_process: bool, tensorboard: bool = True, progress: bool = False) -> None:
        self.run_dir = run_dir
        self.is_main_process = is_main_process
        self._writer = None
        if self.is_main_process and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(run_dir / "tb"))
        self._console = sys.stdout if shows_progress(progress, is_main_process, sys.stdout) else None
        self._bar = tqdm(disable=True)  # no bar before progress() makes one

    def progress(self, desc: str, total: int, done: int = 0) -> tqdm:
        """A bar of `total` steps, `done` of them already; without a console to draw on, a disabled
        one that does nothing. `scalars()` shows each reported `train/loss` on it."""
        self._bar = progress_bar(desc, total, done, self._console)
        return self._bar

    def track(self, iterable: Iterable[T], desc: str) -> Iterable[T]:
        """`iterable` counted by a bar as it is consumed; `iterable` itself when no bar is drawn."""
        return iterable if self._console is None else track(iterable, desc, self._console)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        if "train/loss" in values:
            # Already on the host: no sync. No redraw: the next update() draws it, within tqdm's rate limit.
            self._bar.set_postfix(loss=f"{values['train/loss']:.4f}", refresh=False)
        if self._writer is None:
            return
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, global_step=step)

    def model_summary(self, module: nn.Module) -> None:
        """The module tree and its parameter counts, as text under `model/summary`."""
        if self._writer is not None:
            self._writer.add_text("model/summary", model_summary(module))

    def input_images(self, splits: Any, batches: Iterable[Sequence[int]], task: Any, count: int = 16) -> None:
        """The first `count` samples of the first of `batches` (a sampler's lists of sample indices),
        their first model input as the model receives it, as a grid under `inputs/train_batch`;
        only for datasets of images (`image_size` in their info) whose input is a C x H x W image."""
        if self._writer is None or "image_size" not in splits.info:
            return
        indices = next(iter(batches))[:count]
        inputs = [_first_input(task, splits.train[i]) for i in indices]
        if not all(isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[0] in (1, 3) for x in inputs):
            return
        self._writer.add_image("inputs/train_batch", image_grid(torch.stack(inputs)), global_step=0)

    def confusion_matrix(self, counts: torch.Tensor, step: int) -> None:
        """A confusion matrix of counts (rows: true class): a heatmap under `val/confusion_matrix`
        and the raw counts in confusion_matrix.csv (replaced each time)."""
        if not self.is_main_process:
            return
        if self._writer is not None:
            self._writer.add_image("val/confusion_matrix", confusion_heatmap(counts), global_step=step)
        write_text_atomically(self.run_dir / "confusion_matrix.csv", confusion_csv(counts))

    def hparams(self, hparams: Mapping[str, Any], final_metrics: Mapping[str, float]) -> None:
        """Record the run's hyperparameters with its final metrics (TensorBoard's HParams tab).

        Written into the run's own event file, so multirun jobs line up side by side.
        """
        if self._writer is None:
            return
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        metrics = {f"hparam/{k}": v for k, v in final_metrics.items() if math.isfinite(v)}
        experiment, session_start, session_end = hparams_summary(dict(hparams), metrics)
        file_writer = self._writer._get_file_writer()
        for summary in (experiment, session_start, session_end):
            file_writer.add_summary(summary)
        for tag, value in metrics.items():
            self._writer.add_scalar(tag, value)

    def write_metrics(self, summary: Mapping[str, Any]) -> None:
        """Replace metrics.json atomically, so a reader never sees half a file."""
        if self.is_main_process:
            write_text_atomically(self.run_dir / "metrics.json", json.dumps(summary, indent=2) + "\n")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
