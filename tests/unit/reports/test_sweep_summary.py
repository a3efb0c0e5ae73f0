"""The sweep summary's columns (src/reports/sweep_summary.py) follow the jobs' task: its metrics and its unit."""

from src.reports.sweep_summary import metric_columns


def test_columns_are_the_tasks_metrics_then_epoch_and_throughput_in_its_unit():
    samples = {"val/acc": 0.9, "val/loss": 0.3, "train/loss": 0.2, "epoch": 2, "samples_per_s": 10.0}
    assert metric_columns([samples], "val/acc") == ["val/acc", "val/loss", "train/loss", "epoch", "samples_per_s"]
    tokens = {"val/loss": 2.5, "val/perplexity": 12.2, "train/loss": 2.6, "epoch": 2, "tokens_per_s": 3000.0}
    assert metric_columns([tokens], "val/loss") == ["val/loss", "val/perplexity", "train/loss", "epoch",
                                                    "tokens_per_s"]
    assert metric_columns([{"job": "0", "status": "failed"}], "val/acc")[-1] == "samples_per_s"  # nothing ran yet
