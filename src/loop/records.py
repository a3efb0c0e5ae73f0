"""What the loop reports: an epoch's record (history, metrics.json), its TensorBoard scalars and its log line, and
the run's summary; rates and counts named by the task's unit (`samples_per_s`, `val/num_tokens`)."""

from __future__ import annotations

from typing import Any

_NOT_METRICS = ("count", "timed_count")


def rate_name(unit: str) -> str:
    return f"{unit}_per_s"


def metric_values(split: str, metrics: dict[str, Any]) -> dict[str, float]:
    """`split/<name>` for each metric the task computed; counts and tables are reported on their own."""
    return {f"{split}/{name}": value for name, value in metrics.items()
            if name not in _NOT_METRICS and isinstance(value, float)}


def format_metrics(record: dict[str, Any], split: str) -> str:
    """`train loss 0.1234 acc 0.9876`: a split's metrics of an epoch record, for the log."""
    values = [f"{key.split('/', 1)[1]} {value:.4f}" for key, value in record.items() if key.startswith(f"{split}/")]
    return f"{split} {' '.join(values)}"


def epoch_record(epoch: int, step: int, train: dict[str, Any], val: dict[str, Any], lr: float,
                 epoch_seconds: float, train_seconds: float, extra: dict[str, float] | None = None,
                 unit: str = "samples") -> dict[str, float]:
    """One entry of the run's history: the epoch's train and val metrics, the callbacks' `extra` ones (val_ema/*),
    its lr, time and throughput."""
    return {
        "epoch": epoch,
        "step": step,
        **metric_values("train", train),  # train/loss and the task's metrics
        **metric_values("val", val),
        **(extra or {}),
        "lr": lr,
        "epoch_time_s": epoch_seconds,
        rate_name(unit): train["timed_count"] / train_seconds,
    }


def epoch_scalars(record: dict[str, float], unit: str = "samples") -> dict[str, float]:
    """An epoch record's TensorBoard scalars."""
    return {
        **{key.replace("train/", "epoch/train_"): v for key, v in record.items() if key.startswith("train/")},
        **{key: v for key, v in record.items() if "/" in key and not key.startswith("train/")},
        "time/epoch_s": record["epoch_time_s"],
        f"throughput/epoch_{rate_name(unit)}": record[rate_name(unit)],
    }


def epoch_line(record: dict[str, float], epochs: int, num_val: int, unit: str = "samples") -> str:
    """`epoch 3/20  step 84  train loss ...  val loss ... (359 samples)  5120 samples/s`, the callbacks' splits
    (`val_ema loss ...`) after the val metrics."""
    splits = dict.fromkeys(key.split("/", 1)[0] for key in record if "/" in key and not key.startswith("train/"))
    val = "  ".join(format_metrics(record, split) for split in splits)
    return "epoch %d/%d  step %d  %s  %s (%d %s)  %.0f %s/s" % (
        record["epoch"], epochs, record["step"], format_metrics(record, "train"), val, num_val, unit,
        record[rate_name(unit)], unit)


def window_scalars(window: dict[str, Any], lr: float, per_s: float, unit: str = "samples",
                   samples_per_s: float | None = None) -> dict[str, float]:
    """A log window's train/* scalars, the lr and the throughput: `per_s` units a second, and for a unit other than
    the sample also `samples_per_s` (what MFU is counted in)."""
    rates = {f"throughput/{rate_name(unit)}": per_s}
    if unit != "samples" and samples_per_s is not None:
        rates["throughput/samples_per_s"] = samples_per_s
    return {**metric_values("train", window), "lr": lr, **rates}


def run_summary(history: list[dict[str, float]], num_val: int, world_size: int, global_batch_size: int,
                per_s: float, unit: str = "samples") -> dict[str, Any]:
    """The run so far, as written to metrics.json: the last epoch's metrics, the history, `num_val` (the val units
    the metrics cover) and `per_s` (training throughput)."""
    last = history[-1]
    return {
        **{key: value for key, value in last.items() if "/" in key},  # every split's metrics
        "epoch": last["epoch"],
        "step": last["step"],
        f"val/num_{unit}": num_val,
        "world_size": world_size,
        "global_batch_size": global_batch_size,
        rate_name(unit): per_s,
        "history": history,
    }
