"""A Hydra callback that rewrites the sweep dir's `summary.csv` and `summary.md` after every job, from what the jobs
wrote: one row per job, best first by the monitored metric, and the command that trains the best one again."""

from __future__ import annotations

import atexit
import csv
import io
import shlex
from pathlib import Path
from typing import Any, Sequence

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from src.common.errors import exit_on_usage_error
from src.common.files import write_text_atomically
from src.parallel.job import check_run_dir, composing_args
from src.parallel.ranks import is_main_process
from src.sweeps import jobs

RUN_COLUMNS = ("epoch", "samples_per_s")  # after the metrics, which the jobs' task names
PRUNED_COLUMN = "pruned_epoch"  # after `epoch`, when a job was pruned
SPLITS = ("val/", "test/", "val_ema/", "test_ema/", "train/")  # the metrics' prefixes, in the columns' order


def job_row(job_dir: Path) -> dict[str, Any]:
    metrics, status = jobs.read_metrics(job_dir), jobs.job_state(job_dir)
    pruned = {PRUNED_COLUMN: metrics["stopped_at_epoch"]} if status == "pruned" else {}
    return {"job": job_dir.name, "status": status, "overrides": " ".join(jobs.saved_overrides(job_dir)),
            **{name: value for name, value in metrics.items() if _is_column(name)}, **pruned, "job_dir": str(job_dir)}


def _is_column(name: str) -> bool:
    return name in RUN_COLUMNS or name.endswith("_per_s") or (name.startswith(SPLITS) and "/num_" not in name)


def metric_columns(rows: list[dict[str, Any]], metric: str | None) -> list[str]:
    """The monitored metric and its test/ twin, the other metrics by split, epoch (pruned_epoch), throughput."""
    seen = [name for row in rows for name in row if _is_column(name) and name not in RUN_COLUMNS]
    beside = [f"test/{metric.split('/', 1)[1]}"] if metric and f"test/{metric.split('/', 1)[1]}" in seen else []
    ordered = [*([metric] if metric else []), *beside, *(n for split in SPLITS for n in seen if n.startswith(split))]
    pruned = [PRUNED_COLUMN] if any(PRUNED_COLUMN in row for row in rows) else []
    rates = [name for name in dict.fromkeys(name for row in rows for name in row) if name.endswith("_per_s")]
    return [*dict.fromkeys(ordered), RUN_COLUMNS[0], *pruned, *(rates or RUN_COLUMNS[1:])]


def collect(sweep_dir: Path, metric: str | None, mode: str) -> list[dict[str, Any]]:
    """Rows of every job under `sweep_dir`: completed jobs best first, then the others."""
    rows = [job_row(path.parent.parent) for path in sweep_dir.glob("*/.hydra/overrides.yaml")]
    sign = -1 if mode == "max" else 1

    def order(row: dict[str, Any]) -> tuple:
        value = row.get(metric) if metric else None
        ranked = row["status"] == "completed" and value is not None
        return (not ranked, sign * value if ranked else 0, row["job"].zfill(8))

    return sorted(rows, key=order)


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1000 else f"{value:.0f}"
    return "-" if value is None else str(value)


class SweepSummary(Callback):
    def __init__(self, metric: str, mode: str) -> None:
        self.metric, self.mode = metric, mode

    def write(self, sweep_dir: Path, composing: Sequence[str] = (), show: bool = False) -> str:  # show: print it
        if not sweep_dir.is_dir():  # Hydra could not make it: its `error:` line said so
            return ""
        rows = collect(sweep_dir, self.metric, self.mode)
        columns = metric_columns(rows, self.metric)
        shown = ["job", "status", *columns, "overrides"]
        lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
        lines += ["| " + " | ".join(_format(row.get(column)) for column in shown) + " |" for row in rows]
        table = "\n".join(lines) + "\n"
        if rows and rows[0]["status"] == "completed":  # the best job (rows are best first), trained again
            best = "python train.py " + shlex.join([*composing, *jobs.saved_overrides(Path(rows[0]["job_dir"]))])
            table += f"\nBest job ({rows[0]['job']}), trained again by:\n\n    {best}\n"
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=["job", "status", "overrides", *columns, "job_dir"], restval="")
        writer.writeheader()
        writer.writerows(rows)
        write_text_atomically(sweep_dir / "summary.csv", buffer.getvalue())
        write_text_atomically(sweep_dir / "summary.md", table)
        if show:
            print(f"\nSweep summary (sorted by {self.metric}, {self.mode}): {sweep_dir / 'summary.md'}\n{table}")
        return table

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN or not is_main_process():
            return
        if job_return.status == JobStatus.FAILED:
            error = job_return._return_value
            Path(config.hydra.runtime.output_dir, jobs.FAILED_MARKER).write_text(f"{type(error).__name__}: {error}\n")
        self.write(Path(config.hydra.sweep.dir), composing_args(config.hydra))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        with exit_on_usage_error(is_main_process()):  # resolving a default sweep dir makes it (fresh_dir)
            check_run_dir(Path(config.hydra.sweep.dir))
        if is_main_process():  # printed as the process exits: also after a failed job (Hydra then exits at once)
            atexit.register(self.write, Path(config.hydra.sweep.dir), composing_args(config.hydra), show=True)
