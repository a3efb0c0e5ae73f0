"""A sweep's results at a glance: one row per job with its overrides and final metrics.

A Hydra callback (registered in conf/config.yaml). After every job and at the end of a
multirun it rewrites `summary.csv` and `summary.md` in the sweep dir from what the jobs
wrote (their `.hydra/overrides.yaml` and `metrics.json`), sorted by the monitored metric,
so the table is right whichever launcher ran the jobs and even while a sweep runs. A job
that raised gets a `FAILED` file holding the error and shows as failed. Importing this
module does not import torch.
"""

from __future__ import annotations

import csv
import io
import json
import logging
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from src.common.files import write_text_atomically
from src.parallel.launch import is_main_process

log = logging.getLogger(__name__)

RUN_COLUMNS = ("epoch", "samples_per_s")  # after the metrics, which the jobs' task names
FAILED_MARKER = "FAILED"


def job_row(job_dir: Path) -> dict[str, Any]:
    """One job's overrides, status and final metrics, read from its dir."""
    overrides = OmegaConf.load(job_dir / ".hydra" / "overrides.yaml")
    epochs = OmegaConf.load(job_dir / ".hydra" / "config.yaml").trainer.epochs
    metrics_file = job_dir / "metrics.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {}
    if (job_dir / FAILED_MARKER).exists():
        status = "failed"
    elif metrics.get("epoch") == epochs:
        status = "completed"
    else:
        status = "incomplete"
    row: dict[str, Any] = {"job": job_dir.name, "status": status, "overrides": " ".join(overrides)}
    row.update({name: value for name, value in metrics.items() if _is_column(name)})
    row["job_dir"] = str(job_dir)
    return row


def _is_column(name: str) -> bool:
    return name in RUN_COLUMNS or (name.startswith(("val/", "val_ema/", "train/")) and name != "val/num_samples")


def metric_columns(rows: list[dict[str, Any]], metric: str) -> list[str]:
    """The monitored metric, the other val/, val_ema/ (EMA weights) then train/ metrics the jobs' task
    computes, then epoch and throughput."""
    seen = [name for row in rows for name in row if _is_column(name) and name not in RUN_COLUMNS]
    ordered = [metric, *(n for split in ("val/", "val_ema/", "train/") for n in seen if n.startswith(split))]
    return [*dict.fromkeys(ordered), *RUN_COLUMNS]


def collect(sweep_dir: Path, metric: str, mode: str) -> list[dict[str, Any]]:
    """Rows of every job under `sweep_dir`: completed jobs best first, then the others."""
    job_dirs = [p.parent.parent for p in sweep_dir.glob("*/.hydra/overrides.yaml")]
    rows = [job_row(job_dir) for job_dir in job_dirs]
    sign = -1 if mode == "max" else 1

    def order(row: dict[str, Any]) -> tuple:
        value = row.get(metric)
        ranked = row["status"] == "completed" and value is not None
        return (not ranked, sign * value if ranked else 0, row["job"].zfill(8))

    return sorted(rows, key=order)


def to_markdown(rows: list[dict[str, Any]], metrics: list[str]) -> str:
    columns = ["job", "status", *metrics, "overrides"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [_format(row.get(column)) for column in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def to_csv(rows: list[dict[str, Any]], metrics: list[str]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=["job", "status", "overrides", *metrics, "job_dir"], restval="")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def _format(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


class SweepSummary(Callback):
    """Writes `summary.csv` and `summary.md` into the sweep dir; prints the table at the end."""

    def __init__(self, metric: str, mode: str) -> None:
        self.metric = metric  # the task's monitored metric (trainer.monitor), unless overridden
        self.mode = mode

    def write(self, sweep_dir: Path) -> str:
        rows = collect(sweep_dir, self.metric, self.mode)
        columns = metric_columns(rows, self.metric)
        table = to_markdown(rows, columns)
        write_text_atomically(sweep_dir / "summary.csv", to_csv(rows, columns))
        write_text_atomically(sweep_dir / "summary.md", table)
        return table

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN or not is_main_process():
            return
        job_dir = Path(config.hydra.runtime.output_dir)
        if job_return.status == JobStatus.FAILED:
            error = job_return._return_value
            (job_dir / FAILED_MARKER).write_text(f"{type(error).__name__}: {error}\n")
        self.write(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not is_main_process():
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        table = self.write(sweep_dir)
        print(f"\nSweep summary (sorted by {self.metric}, {self.mode}): {sweep_dir / 'summary.md'}\n{table}")
