"""What the loop reports: an epoch's record (history, metrics.json), its TensorBoard scalars and its
log line, and the run's summary. Plain data in, plain data out: the loop decides when."""

from __future__ import annotations

from typing import Any

_NOT_METRICS = ("count", "timed_count")


def metric_values(split: str, metrics: dict[str, Any]) -> dict[str, float]:
    """`split/<name>` for each metric the task computed; counts and tables (e.g. the confusion
    matrix) are reported on their own."""
    return {f"{split}/{name}": value for name, value in metrics.items()
            if name not in _NOT_METRICS and isinstance(value, float)}


def format_metrics(record: dict[str, Any], split: str) -> str:
    """`train loss 0.1234 acc 0.9876`: a split's metrics of an epoch record, for the log."""
    values = [f"{key.split('/', 1)[1]} {value:.4f}" for key, value in record.items() if key.startswith(f"{split}/")]
    return f"{split} {' '.join(values)}"


def epoch_record(epoch: int, step: int, train: dict[str, Any], val: dict[str, Any], lr: float,
                 epoch_seconds: float, train_seconds: float, extra: dict[str, float] | None = None) -> dict[str, float]:
    """One entry of the run's history: the epoch's train and val metrics, the callbacks' `extra` metrics
    (`split/<name>`, e.g. val_ema/*: the EMA weights' val metrics), its lr, time and throughput."""
    return {
        "epoch": epoch,
        "step": step,
        **metric_values("train", train),  # train/loss and the task's metrics
        **metric_values("val", val),
        **(extra or {}),
        "lr": lr,
        "epoch_time_s": epoch_seconds,
        "samples_per_s": train["timed_count"] / train_seconds,
    }


def epoch_scalars(record: dict[str, float]) -> dict[str, float]:
    """An epoch record's TensorBoard scalars."""
    return {
        **{key.replace("train/", "epoch/train_"): v for key, v in record.items() if key.startswith("train/")},
        **{key: v for key, v in record.items() if "/" in key and not key.startswith("train/")},
        "time/epoch_s": record["epoch_time_s"],
        "throughput/epoch_samples_per_s": record["samples_per_s"],
    }


def epoch_line(record: dict[str, float], epochs: int, num_val: int) -> str:
    """`epoch 3/20  step 84  train loss ...  val loss ... (359 samples)  5120 samples/s`, with the callbacks'
    splits after the val metrics (e.g. `val_ema loss ...` when the EMA weights are validated too)."""
    splits = dict.fromkeys(key.split("/", 1)[0] for key in record if "/" in key and not key.startswith("train/"))
    val = "  ".join(format_metrics(record, split) for split in splits)
    return "epoch %d/%d  step %d  %s  %s (%d samples)  %.0f samples/s" % (
        record["epoch"], epochs, record["step"], format_metrics(record, "train"), val, num_val,
        record["samples_per_s"])


def window_scalars(window: dict[str, Any], lr: float, samples_per_s: float) -> dict[str, float]:
    """A log window's train/* scalars, with the lr and the throughput."""
    return {**metric_values("train", window), "lr": lr, "throughput/samples_per_s": samples_per_s}


def run_summary(history: list[dict[str, float]], num_val_samples: int, world_size: int, global_batch_size: int,
                samples_per_s: float) -> dict[str, Any]:
    """The run so far, as written to metrics.json: the last epoch's metrics and the history."""
    last = history[-1]
    return {
        **{key: value for key, value in last.items() if "/" in key},  # every split's metrics
        "epoch": last["epoch"],
        "step": last["step"],
        "val/num_samples": num_val_samples,
        "world_size": world_size,
        "global_batch_size": global_batch_size,
        "samples_per_s": samples_per_s,
        "history": history,
    }
