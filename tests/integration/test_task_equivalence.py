"""The distributed guarantees hold for every task, not only classification: the real command line
on 1, 2 and 3 processes for the binary and regression tasks (classification: tests/test_equivalence.py).

- 2 ranks x B with sync-BN train the weights 1 process x 2B trains (SGD), and without sync-BN they do not;
- val metrics are identical on 1, 2 and 3 ranks for a val split of prime size;
- a run stopped mid-epoch and resumed ends bitwise equal to an uninterrupted one.

Each run is launched once per module, on first use, and shared by the tests that read it (LazyRuns).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TWO_THREADS, check, copy_run, metrics, train, weights
from lazy_runs import LazyRuns
from test_equivalence import assert_all_close, max_abs_diffs, without_timings

pytestmark = pytest.mark.slow

# Models with BatchNorm, SGD (FACTS.md: Adam amplifies float rounding), one epoch and a half.
EQUIVALENCE = {
    # 2-class synthetic images: one logit per sample from the CNN.
    "binary": ["task=binary", "model=cnn", "dataset=synthetic", "dataset.num_classes=2", "dataset.image_size=[8,8]",
               "dataset.num_train=480", "dataset.num_val=96", "dataset.batch_size=32"],
    # (rgb, mask) -> target with the two-input CNN and an L1 loss, as in the seed system; no layout restated:
    # the task binds model(rgb, mask) and the target by the dataset's field names.
    "regression": ["task=regression", "task.loss=l1", "model=two_input_cnn", "dataset=two_input_synthetic",
                   "dataset.num_train=240", "dataset.num_val=48", "dataset.batch_size=12"],
}
# lr 0.01: at 0.05, 30 steps of BCE grow float rounding to 5e-5 (at 0.01: 7e-8).
COMMON = ["optimizer=sgd", "optimizer.lr=0.01", "scheduler=constant", "trainer.epochs=2", "trainer.log_every_steps=5"]
# Val exactness: lr=0 and no BatchNorm, so every world size evaluates the very same model (see
# tests/test_equivalence.py); prime val sizes, global batches divisible by 1, 2 and 3.
VAL = {
    "binary": ["task=binary", "model=mlp", "dataset=breast_cancer", "dataset.val_size=113", "dataset.batch_size=48"],
    "regression": ["task=regression", "model=mlp", "dataset=diabetes", "dataset.val_size=89", "dataset.batch_size=48"],
}
VAL_COMMON = ["optimizer=sgd", "optimizer.lr=0.0", "scheduler=constant", "trainer.epochs=1"]
TASKS = sorted(EQUIVALENCE)
# The middle of epoch 2: 15 steps an epoch (480 / 32) for binary, 20 (240 / 12) for regression.
STOP_AT = {"binary": 15 + 7, "regression": 20 + 10}
COUNTED = {"val/acc", "val/precision", "val/recall", "val/f1"}


def runs_of(task: str) -> dict[str, tuple[int, list[str]]]:
    base = [*EQUIVALENCE[task], *COMMON]
    return {
        f"{task} 1 rank": (1, base),
        f"{task} 2 ranks": (2, base),
        f"{task} 2 ranks without sync-BN": (2, [*base, "dist.sync_bn=false"]),
        f"{task} stopped": (1, [*base, f"trainer.max_steps={STOP_AT[task]}"]),
        f"{task} val 1": (1, [*VAL[task], *VAL_COMMON]),
        f"{task} val 2": (2, [*VAL[task], *VAL_COMMON]),
        f"{task} val 3": (3, [*VAL[task], *VAL_COMMON]),
    }


class Runs(LazyRuns):
    """Each (task, kind) run launched once, when a test first asks for one (LazyRuns: with the other runs on as
    many processes); returns its run dir."""

    def __call__(self, task: str, kind: str) -> Path:  # type: ignore[override]
        return super().__call__(f"{task} {kind}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("task_equivalence"), {k: v for task in TASKS for k, v in runs_of(task).items()})


@pytest.mark.parametrize("task", TASKS)
def test_sync_bn_two_ranks_train_the_one_process_model(runs: Runs, task: str):
    one, two = weights(runs(task, "1 rank")), weights(runs(task, "2 ranks"))
    assert any("running_var" in name for name in one)
    assert_all_close(one, two, atol=1e-5)
    for key in (f"train/{name}" for name in ("loss", "mae" if task == "regression" else "acc")):
        assert metrics(runs(task, "2 ranks"))[key] == pytest.approx(metrics(runs(task, "1 rank"))[key], abs=1e-5)


@pytest.mark.parametrize("task", TASKS)
def test_without_sync_bn_two_ranks_train_another_model(runs: Runs, task: str):
    diffs = max_abs_diffs(weights(runs(task, "1 rank")), weights(runs(task, "2 ranks without sync-BN")))
    assert max(diffs.values()) > 1e-4, diffs


@pytest.mark.parametrize("task", TASKS)
def test_val_metrics_are_identical_on_one_two_and_three_ranks(runs: Runs, task: str):
    reference = metrics(runs(task, "val 1"))
    names = [key for key in reference if key.startswith("val/") and key != "val/num_samples"]
    assert len(names) == (5 if task == "binary" else 4)  # loss + acc, precision, recall, f1 | mae, rmse, r2
    for kind in ("val 2", "val 3"):
        summary = metrics(runs(task, kind))
        assert summary["val/num_samples"] == reference["val/num_samples"] == (113 if task == "binary" else 89)
        for name in names:
            if name in COUNTED:  # ratios of counts: exactly equal
                assert summary[name] == reference[name], (kind, name)
            else:  # per-sample values from float32 batches of another size (BLAS blocking): rounding only
                assert summary[name] == pytest.approx(reference[name], abs=1e-6), (kind, name)


@pytest.mark.parametrize("task", TASKS)
def test_a_run_stopped_mid_epoch_and_resumed_ends_bitwise_equal(runs: Runs, task: str):
    straight = runs(task, "1 rank")
    steps_per_epoch = metrics(straight)["history"][0]["step"]
    stop_at = steps_per_epoch + steps_per_epoch // 2  # in the middle of epoch 2
    assert STOP_AT[task] == stop_at
    assert f"stopped at step {stop_at} with a checkpoint" in (runs(task, "stopped") / "train.log").read_text()
    run_dir = copy_run(runs(task, "stopped"), runs.root / f"{task}_resumed")
    args = [*EQUIVALENCE[task], *COMMON, f"hydra.run.dir={run_dir}"]
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert set(saved["loop"]["epoch_totals"]) >= {"loss", "count"}  # the unfinished epoch's metric sums, by name
    check(train([*args, "resume=auto"], runs.root, env=TWO_THREADS))  # as LazyRuns ran the others
    assert without_timings(metrics(run_dir)) == without_timings(metrics(straight))
    for name, tensor in weights(straight).items():
        assert torch.equal(tensor, weights(run_dir)[name]), name
