"""What a run leaves behind for people: log files, TensorBoard events and metrics.json.

Rank 0 prints INFO to the console and writes `train.log` (`eval.log` for eval.py),
TensorBoard events (`tb/`) and `metrics.json`; every other rank writes its own
`train.rank<R>.log` and prints only warnings, so a crash on any rank is still visible.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Mapping

_FORMAT = "[%(asctime)s][%(levelname)s] %(message)s"
FINAL_METRICS = ("train/loss", "train/acc", "val/loss", "val/acc")


def setup_logging(run_dir: Path, rank: int, name: str = "train") -> None:
    """Send this rank's log records to its file in the run dir, `<name>.log` or
    `<name>.rank<R>.log` (and rank 0's to stdout)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.INFO)
    filename = f"{name}.log" if rank == 0 else f"{name}.rank{rank}.log"
    handlers: list[logging.Handler] = [logging.FileHandler(run_dir / filename)]
    console = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    handlers.append(console)
    for handler in handlers:
        handler.setFormatter(logging.Formatter(_FORMAT if rank == 0 else f"[rank {rank}]{_FORMAT}"))
        root.addHandler(handler)


def log_run_start(run_dir: Path, runtime: Any, module: Any, data: Any, grad_accum: int) -> None:
    """One summary of what is about to run (logged by every rank, printed by rank 0)."""
    sampler = data.train_sampler
    logging.getLogger("train").info(
        "run dir %s | world size %d | device %s | backend %s | model %s (%.2fM params) | "
        "%d train / %d val samples | global batch %d = %d ranks x %d per rank x %d accum | %d steps/epoch",
        run_dir, runtime.world_size, runtime.device, runtime.backend or "none (single process)",
        type(module).__name__, sum(p.numel() for p in module.parameters()) / 1e6,
        len(data.splits.train), len(data.splits.val), sampler.global_batch_size, runtime.world_size,
        sampler.micro_batch_size, grad_accum, sampler.steps_per_epoch,
    )


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`; lists become strings (TensorBoard's HParams take scalars)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


class Reporter:
    """TensorBoard scalars, HParams and metrics.json, written by the main process only.

    With `tensorboard=False` it writes metrics.json alone (no `tb/` dir, no TensorBoard import).
    """

    def __init__(self, run_dir: Path, is_main_process: bool, tensorboard: bool = True) -> None:
        self.run_dir = run_dir
        self.enabled = is_main_process
        self._writer = None
        if self.enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(run_dir / "tb"))

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        if self._writer is None:
            return
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, global_step=step)

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
        if not self.enabled:
            return
        path = self.run_dir / "metrics.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, path)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
