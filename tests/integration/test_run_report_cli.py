"""What a real run shows and leaves for people, on 1 process and on 2 (torchrun): the start-of-run
summary, no progress-bar noise outside a terminal, and TensorBoard's images, model summary and
the val confusion matrix, exact under DDP; the 2 ranks' one run dir, and the self-launched group that trains
what torchrun's trains (the same torchrun run: launched once, read by every test here)."""

from __future__ import annotations

import csv
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, check, metrics, torchrun, train, weights
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_launch_cli import history_without_timing

from src.components.models import SimpleCNN

pytestmark = pytest.mark.slow

ONE_EPOCH = ["trainer.epochs=1"]


def run_in(workdir: Path, launch) -> tuple[Path, subprocess.CompletedProcess]:  # noqa: ANN001 - a conftest launcher
    result = check(launch(workdir))
    (run_dir,) = [p for p in (workdir / "outputs").glob("*/*") if p.is_dir()]
    return run_dir, result


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`torchrun --nproc_per_node=2 train.py trainer.epochs=1` with rank 1 starting 1.5 s late (with Hydra's
    ${now:} it would create a second run dir): its run dir and output."""
    delayed = str(REPO / "tests" / "fixtures" / "delayed_start.py")
    return run_in(tmp_path_factory.mktemp("report"), lambda cwd: torchrun(2, ONE_EPOCH, cwd, script=delayed))


@pytest.fixture(scope="module", params=["1 process", "torchrun 2 ranks"])
def finished_run(request, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A one-epoch digits run (stdout and stderr are pipes, not a terminal): its run dir and output."""
    if request.param == "1 process":
        return run_in(tmp_path_factory.mktemp("report"), lambda cwd: train(ONE_EPOCH, cwd))
    return request.getfixturevalue("two_ranks")


def read_confusion_csv(run_dir: Path) -> torch.Tensor:
    header, *rows = list(csv.reader((run_dir / "confusion_matrix.csv").open()))
    assert header == ["true\\predicted", *map(str, range(10))]
    assert [row[0] for row in rows] == [str(c) for c in range(10)]
    return torch.tensor([[int(n) for n in row[1:]] for row in rows])


def test_confusion_matrix_counts_every_val_sample_once_and_matches_val_acc(finished_run):
    run_dir, _ = finished_run
    summary = metrics(run_dir)
    confusion = read_confusion_csv(run_dir)
    assert confusion.sum().item() == summary["val/num_samples"] == 180
    assert confusion.trace().item() / confusion.sum().item() == summary["val/acc"]


def test_tensorboard_has_input_grid_model_summary_and_confusion_image(finished_run):
    run_dir, _ = finished_run
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    assert {"inputs/train_batch", "val/confusion_matrix"} <= set(events.Tags()["images"])
    assert events.Images("val/confusion_matrix")[-1].step == metrics(run_dir)["step"]
    grid = events.Images("inputs/train_batch")[0]
    assert (grid.width, grid.height) == (8 * 34 + 2, 2 * 34 + 2)  # 16 digits, 8x8 enlarged to 32x32
    summary = events.Tensors("model/summary/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| **total** | SimpleCNN |" in summary and "(classifier): Sequential(" in summary


def test_start_summary_is_printed_once_and_no_progress_bar_outside_a_terminal(finished_run):
    """The console: the overrides and the run-start line once; the resolved config in each rank's log file."""
    run_dir, result = finished_run
    assert result.stdout.count("[INFO] overrides: trainer.epochs=1\n") == 1
    assert result.stdout.count("| world size ") == 1
    assert "config:\n" not in result.stdout and "_target_: src.components.models.SimpleCNN" not in result.stdout
    logs = [run_dir / "train.log", *sorted(run_dir.glob("train.rank*.log"))]
    assert len(logs) == metrics(run_dir)["world_size"]
    for log in logs:
        text = log.read_text()
        assert text.count("config:\n") == 1 and "_target_: src.components.models.SimpleCNN" in text, log
        assert "trainer:\n  epochs: 1\n" in text, log
    assert "parameters, " in result.stdout and "per rank" in result.stdout
    assert "epochs: 1" in (run_dir / ".hydra" / "config.yaml").read_text()  # Hydra's copy is still saved
    for output in (result.stdout, result.stderr):
        assert "\r" not in output and "%|" not in output and "step/s" not in output and "batch/s" not in output


def test_torchrun_two_workers_share_one_run_dir(two_ranks):
    run_dir, result = two_ranks
    workdir = run_dir.parents[2]
    assert [p for p in (workdir / "outputs").glob("*/*")] == [run_dir]
    assert len(list(workdir.rglob("config.yaml"))) == 1
    assert (run_dir / "train.rank1.log").exists()
    assert sorted(p.name for p in (run_dir / "tb").iterdir())[0].startswith("events.out.tfevents")
    assert len(list((run_dir / "tb").iterdir())) == 1  # rank 0 alone writes TensorBoard
    summary = metrics(run_dir)
    assert summary["world_size"] == 2 and summary["val/num_samples"] == summary["test/num_samples"] == 180
    assert summary["step"] == 1437 // 64
    assert "world size 2" in result.stdout and "backend gloo" in result.stdout
    SimpleCNN(in_channels=1, image_size=(8, 8), num_outputs=10).load_state_dict(weights(run_dir))


def test_self_launch_matches_torchrun(two_ranks, workdir: Path):
    check(train(["dist.nproc_per_node=2", "trainer.epochs=1", "hydra.run.dir=self"], workdir))
    self_dir = workdir / "self"
    assert metrics(self_dir)["world_size"] == 2
    assert history_without_timing(self_dir) == history_without_timing(two_ranks[0])
    assert (self_dir / "train.rank1.log").exists() and (self_dir / ".hydra" / "config.yaml").exists()
    assert "nproc_per_node=2" in (self_dir / ".hydra" / "overrides.yaml").read_text()
    assert [p.name for p in workdir.iterdir()] == ["self"]  # no outputs/: the run dir is the one named
