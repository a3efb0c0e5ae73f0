"""eval.py end to end: a checkpoint of one short training run, evaluated on 1, 2 and 3 processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, check, copy_run, metrics, run, torchrun

pytestmark = pytest.mark.slow

EVAL = str(REPO / "eval.py")


def evaluate(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`python eval.py ARGS` in `cwd`."""
    return run([sys.executable, EVAL, *args], cwd)


def only_eval_dir(workdir: Path) -> Path:
    """The single run dir under workdir/outputs/eval/DATE/TIME (fails if there are several)."""
    run_dirs = [p for p in (workdir / "outputs" / "eval").glob("*/*") if p.is_dir()]
    assert len(run_dirs) == 1, f"expected one eval run dir, found {run_dirs}"
    return run_dirs[0]


@pytest.fixture(scope="module")
def trained(one_epoch_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run dir of one epoch of training on digits (180 val samples, 180 test samples)."""
    return copy_run(one_epoch_run, tmp_path_factory.mktemp("train") / "run")


@pytest.fixture(scope="module")
def one_process_359(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """metrics.json of a 1-process evaluation on a 359-sample val split (odd: uneven shards)."""
    workdir = tmp_path_factory.mktemp("eval1")
    check(evaluate([f"checkpoint={trained / 'checkpoints' / 'last.pt'}", "dataset.val_size=359", "split=val"],
                   workdir))
    return metrics(only_eval_dir(workdir))


def test_eval_reproduces_the_training_runs_val_metrics(trained: Path):
    train_metrics_before = (trained / "metrics.json").read_bytes()
    workdir = trained.parent  # where the training run was launched from
    result = check(evaluate(["checkpoint=run/checkpoints/last.pt", "split=val"], workdir))
    eval_dir = only_eval_dir(workdir)
    assert f"run dir: {eval_dir.resolve()}" in result.stdout and "val/acc=" in result.stdout
    assert (eval_dir / "eval.log").exists() and not (eval_dir / "tb").exists()

    trained_metrics, evaluated = metrics(trained), metrics(eval_dir)
    assert evaluated["val/acc"] == trained_metrics["val/acc"]
    assert evaluated["val/loss"] == pytest.approx(trained_metrics["val/loss"], abs=1e-6)
    assert evaluated["num_samples"] == 180 and evaluated["world_size"] == 1 and evaluated["epoch"] == 1
    assert (trained / "metrics.json").read_bytes() == train_metrics_before  # the training run is untouched


def test_eval_evaluates_the_test_split_by_default_as_the_run_s_final_test_did(trained: Path, tmp_path: Path):
    check(evaluate([f"checkpoint={trained / 'checkpoints' / 'best.pt'}"], tmp_path))
    trained_metrics, evaluated = metrics(trained), metrics(only_eval_dir(tmp_path))
    assert evaluated["split"] == "test" and evaluated["num_samples"] == trained_metrics["test/num_samples"] == 180
    assert evaluated["test/acc"] == trained_metrics["test/acc"]
    assert evaluated["test/loss"] == pytest.approx(trained_metrics["test/loss"], abs=1e-6)
    assert "val/acc" not in evaluated


@pytest.mark.parametrize("nproc", [2, 3])
def test_sharded_eval_equals_one_process(trained: Path, one_process_359: dict, tmp_path: Path, nproc: int):
    # 359 samples: shards of 180/179 on 2 ranks, 120/120/119 on 3, per-rank batches 32 and 21.
    args = [f"checkpoint={trained / 'checkpoints' / 'last.pt'}", "dataset.val_size=359", "split=val"]
    result = check(torchrun(nproc, args, tmp_path, script=EVAL))
    sharded = metrics(only_eval_dir(tmp_path))  # one run dir for the whole group
    assert len(list(tmp_path.rglob("config.yaml"))) == 1  # .hydra/ written by rank 0 alone
    assert f"world_size={nproc}" in result.stdout
    assert sharded["world_size"] == nproc and one_process_359["world_size"] == 1
    assert sharded["num_samples"] == one_process_359["num_samples"] == 359
    assert sharded["val/acc"] == one_process_359["val/acc"]
    assert sharded["val/loss"] == pytest.approx(one_process_359["val/loss"], abs=1e-6)


def test_help_lists_eval_s_options(tmp_path: Path):
    result = check(run([sys.executable, EVAL, "--help"], tmp_path))
    assert "eval.py: evaluate a checkpoint" in result.stdout
    assert "dataset: arrow, breast_cancer, checkpoint, cifar10" in result.stdout
    assert "eval.py chooses only dataset (the model comes from the checkpoint)" in result.stdout


def bad_checkpoint(kind: str, folder: Path, trained: Path) -> Path:
    """A file in `folder` that is not a checkpoint of this template, or else the good one."""
    path = folder / f"{kind}.pt"
    if kind == "random_bytes":
        path.write_bytes(bytes(range(256)) * 4)
    elif kind == "plain_dict":
        torch.save({"a": 1}, path)
    elif kind != "missing":
        path = trained / "checkpoints" / "last.pt"  # a good file, refused for its extra arguments
    return path


@pytest.mark.parametrize(
    "kind,extra,message",
    [
        ("missing", [], "does not exist"),
        ("random_bytes", [], "cannot be read"),
        ("plain_dict", [], "is not a checkpoint of this template"),
        # 28x28 synthetic images for a model built for 8x8 digits
        ("good", ["dataset=synthetic"], "does not fit this model"),
        ("good", ["dataset.val_sise=359"], "dataset.val_sise is not a key of the dataset config"),
    ],
)
def test_bad_checkpoint_is_one_clear_error(trained: Path, tmp_path: Path, kind: str, extra: list, message: str):
    path = bad_checkpoint(kind, tmp_path, trained)
    result = evaluate([f"checkpoint={path}", *extra], tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, result.stderr[-2000:]
    assert message in error_lines[0] and str(path) in error_lines[0]
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.glob("outputs/eval/*/*/metrics.json"))
