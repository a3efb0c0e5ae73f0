"""The sweep summary's columns (src/reports/sweep_summary.py) follow the jobs' task: its metrics and its unit."""

from src.reports.sweep_summary import SweepSummary, metric_columns


def test_columns_are_the_tasks_metrics_then_epoch_and_throughput_in_its_unit():
    samples = {"val/acc": 0.9, "val/loss": 0.3, "train/loss": 0.2, "epoch": 2, "samples_per_s": 10.0}
    assert metric_columns([samples], "val/acc") == ["val/acc", "val/loss", "train/loss", "epoch", "samples_per_s"]
    tokens = {"val/loss": 2.5, "val/perplexity": 12.2, "train/loss": 2.6, "epoch": 2, "tokens_per_s": 3000.0}
    assert metric_columns([tokens], "val/loss") == ["val/loss", "val/perplexity", "train/loss", "epoch",
                                                    "tokens_per_s"]
    assert metric_columns([{"job": "0", "status": "failed"}], "val/acc")[-1] == "samples_per_s"  # nothing ran yet


def test_the_test_metric_stands_beside_the_ranked_val_one_and_ranks_nothing():
    import json
    import tempfile
    from pathlib import Path

    from src.reports.sweep_summary import collect

    job = {"val/acc": 0.9, "val/loss": 0.3, "test/acc": 0.8, "test/loss": 0.4, "test/num_samples": 180,
           "train/loss": 0.2, "epoch": 2, "samples_per_s": 10.0}
    assert metric_columns([job], "val/acc") == ["val/acc", "test/acc", "val/loss", "test/loss", "train/loss", "epoch",
                                                "samples_per_s"]
    with tempfile.TemporaryDirectory() as folder:  # ranked by val alone: the job with the better test comes second
        for name, val, test in (("0", 0.9, 0.7), ("1", 0.8, 0.99)):
            (Path(folder) / name / ".hydra").mkdir(parents=True)
            (Path(folder) / name / ".hydra" / "overrides.yaml").write_text(f"- seed={name}\n")
            (Path(folder) / name / "metrics.json").write_text(json.dumps({**job, "val/acc": val, "test/acc": test}))
        assert [row["job"] for row in collect(Path(folder), "val/acc", "max")] == ["0", "1"]


def test_a_sweep_dir_hydra_could_not_make_gets_no_summary(tmp_path):
    # Written as the process exits, also when Hydra's launcher failed to make the dir (its `error:` line said so).
    never_made = tmp_path / "not_a_folder" / "sweep"
    (tmp_path / "not_a_folder").write_text("")
    assert SweepSummary("val/acc", "max").write(never_made, show=True) == ""
    assert [p.name for p in tmp_path.iterdir()] == ["not_a_folder"]
