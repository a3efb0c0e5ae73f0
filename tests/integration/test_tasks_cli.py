"""The seed systems and the new tasks through the real command line, on 1 process and on 2 torchrun ranks:
their quality bars, and everything downstream named by the task (metrics.json, TensorBoard, best.pt,
the value a sweep sorts by, HParams)."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import TRAIN, check, metrics, run, train
from lazy_runs import LazyRuns
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from src.components.datasets import two_input_synthetic

pytestmark = pytest.mark.slow

SYSTEMS = {  # name: overrides
    "seed_tabular_binary": ["experiment=seed_tabular_binary"],
    "diabetes_mlp": ["task=regression", "dataset=diabetes", "model=mlp"],
    "seed_two_input_l1": ["experiment=seed_two_input_l1"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    """Each system's run on 1 process and on 2 ranks (LazyRuns: the runs on as many processes share a launch)."""
    systems = {f"{name}_{processes}": (processes, overrides)
               for name, overrides in SYSTEMS.items() for processes in (1, 2)}
    # One thread: these runs are compared with no other, and the seeds' tiny batches leave a second thread waiting.
    lazy = LazyRuns(tmp_path_factory.mktemp("tasks_cli"), systems, env={"OMP_NUM_THREADS": "1"})
    return lambda name, processes: lazy(f"{name}_{processes}")


def mean_target_mae() -> float:
    """The val mae of predicting the train split's mean target: what the two-input model must beat 4x."""
    splits = two_input_synthetic()
    mean = splits.train.tensors[2].mean()
    return (splits.val.tensors[2] - mean).abs().mean().item()


@pytest.mark.parametrize("processes", [1, 2])
def test_seed_tabular_binary_reaches_95_percent(runs, processes: int):
    summary = metrics(runs("seed_tabular_binary", processes))
    assert summary["val/acc"] >= 0.95, summary["val/acc"]
    assert {"val/precision", "val/recall", "val/f1", "train/f1"} <= set(summary)
    assert summary["global_batch_size"] == 10 and summary["world_size"] == processes
    print(f"seed_tabular_binary {processes} rank(s): val/acc {summary['val/acc']:.4f}")


@pytest.mark.parametrize("processes", [1, 2])
def test_diabetes_regression_reaches_r2_035(runs, processes: int):
    summary = metrics(runs("diabetes_mlp", processes))
    assert summary["val/r2"] >= 0.35, summary["val/r2"]
    assert summary["val/num_samples"] == summary["test/num_samples"] == 44
    print(f"diabetes mlp {processes} rank(s): val/r2 {summary['val/r2']:.4f}")


@pytest.mark.parametrize("processes", [1, 2])
def test_seed_two_input_beats_the_mean_predictor_four_times(runs, processes: int):
    summary = metrics(runs("seed_two_input_l1", processes))
    baseline = mean_target_mae()
    assert summary["val/mae"] <= 0.25 * baseline, (summary["val/mae"], baseline)
    assert summary["val/loss"] == pytest.approx(summary["val/mae"], abs=1e-9)  # one target value: L1 loss is mae
    assert summary["global_batch_size"] == 6
    print(f"seed_two_input_l1 {processes} rank(s): val/mae {summary['val/mae']:.4f} = "
          f"{summary['val/mae'] / baseline:.3f} x the mean predictor's {baseline:.4f}")


def test_downstream_outputs_are_named_by_the_task(runs):
    run_dir = runs("diabetes_mlp", 1)
    summary = metrics(run_dir)
    assert {"val/mae", "val/rmse", "val/r2", "train/mae"} <= set(summary) and "val/acc" not in summary
    best = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    best_epoch = min(summary["history"], key=lambda h: h["val/mae"])["epoch"]  # monitor: val/mae, min
    assert best["loop"]["epoch"] == best_epoch
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    assert {"val/mae", "val/r2", "train/rmse", "hparam/val/r2"} <= set(events.Tags()["scalars"])
    assert "val/acc" not in events.Tags()["scalars"]
    assert events.Tags()["images"] == []  # no input grid for feature vectors, no confusion matrix
    assert not (run_dir / "confusion_matrix.csv").exists()
    log = (run_dir / "train.log").read_text()
    assert "train loss" in log and " r2 " in log and "final: " in log and "val/r2=" in log


def test_a_regression_sweep_sorts_by_the_tasks_metric(tmp_path: Path):
    args = ["-m", "task=regression", "dataset=diabetes", "model=linear", "optimizer=sgd", "optimizer.lr=0.3,0.001",
            "trainer.epochs=2", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    result = check(run([sys.executable, TRAIN, *args], tmp_path))
    assert "Sweep summary (sorted by val/mae, min)" in result.stdout
    rows = list(csv.DictReader((tmp_path / "sweep" / "summary.csv").open()))
    maes = [float(row["val/mae"]) for row in rows]
    assert maes == sorted(maes) and len(maes) == 2
    assert list(rows[0])[3:7] == ["val/mae", "test/mae", "val/loss", "val/rmse"]  # test beside the ranked metric
    for row in rows:
        job = json.loads((Path(row["job_dir"]) / "metrics.json").read_text())
        assert (float(row["val/mae"]), float(row["test/mae"])) == (job["val/mae"], job["test/mae"])


def test_a_model_output_the_task_cannot_use_is_one_error_line_before_any_update(tmp_path: Path):
    result = train(["model.num_outputs=5", "trainer.epochs=1", "hydra.run.dir=run"], tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: task=classification takes logits of shape (N, num_classes) = (64, 10) for targets of "
                      "shape (64,), but the model returns (64, 5): build it with model.num_outputs=10 (its YAML's "
                      "${data:num_outputs})"], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "metrics.json").exists()
