"""A damaged newest checkpoint, through the real CLI: `resume=auto` goes on from the newest one that
loads and ends exactly where an uninterrupted run ends; the ranks resume from one file chosen by rank 0, or
none of them trains at all. The runs the tests copy and compare with share launches (LazyRuns)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, TRAIN, TWO_THREADS, check, free_port, metrics, run, torchrun, train, weights
from lazy_runs import LazyRuns

TWO_EPOCHS = ["trainer.epochs=2", "optimizer=sgd", "optimizer.lr=0.01", "scheduler=constant"]
STOPPED = [*TWO_EPOCHS, "trainer.checkpoint_every_steps=5", "trainer.max_steps=27"]
TIMING_KEYS = {"epoch_time_s", "samples_per_s"}


def damage(checkpoints: Path) -> None:
    """The two newest states unreadable: last.pt cut short, step 27 empty; step 25 is intact."""
    last = checkpoints / "last.pt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    (checkpoints / "step_000000027.pt").write_bytes(b"")


def without_timing(summary: dict) -> dict:
    history = [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in summary["history"]]
    return {**{k: v for k, v in summary.items() if k not in TIMING_KEYS}, "history": history}


def assert_bitwise_equal(run_dir: Path, reference: Path) -> None:
    assert without_timing(metrics(run_dir)) == without_timing(metrics(reference))
    for name, tensor in weights(reference).items():
        assert torch.equal(tensor, weights(run_dir)[name]), name


# -- the real command line ----------------------------------------------------------------------


RUNS: dict[str, tuple[int, list[str]]] = {  # name: (processes, overrides); LazyRuns launches them
    "stopped": (1, STOPPED),  # stopped at step 27 with step checkpoints every 5 steps (25 and 27 kept)
    "straight": (1, TWO_EPOCHS),  # two epochs, never interrupted
    "stopped on 2": (2, STOPPED),
    "straight on 2": (2, TWO_EPOCHS),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> LazyRuns:
    return LazyRuns(tmp_path_factory.mktemp("resume"), RUNS)


@pytest.fixture(scope="module")
def stopped(runs: LazyRuns) -> Path:
    return runs("stopped")


@pytest.mark.slow
def test_a_damaged_last_checkpoint_resumes_from_the_newest_that_loads_exactly(tmp_path: Path, runs: LazyRuns):
    shutil.copytree(runs("stopped"), tmp_path / "run")
    damage(tmp_path / "run" / "checkpoints")

    explicit = train([*TWO_EPOCHS, "resume=run/checkpoints/last.pt", "hydra.run.dir=run"], tmp_path)
    assert explicit.returncode == 2 and "Traceback" not in explicit.stderr
    (error,) = [line for line in explicit.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith("error: checkpoint run/checkpoints/last.pt cannot be read")  # no fallback

    result = check(train([*TWO_EPOCHS, "resume=auto", "hydra.run.dir=run"], tmp_path, env=TWO_THREADS))  # as LazyRuns
    log = (tmp_path / "run" / "train.log").read_text()
    checkpoints = tmp_path / "run" / "checkpoints"
    assert f"resume: skipping a damaged checkpoint: checkpoint {checkpoints / 'last.pt'} cannot be read" in log
    assert f"resume: skipping a damaged checkpoint: checkpoint {checkpoints / 'step_000000027.pt'} cannot" in log
    assert f"continuing from {checkpoints / 'step_000000025.pt'}, the newest checkpoint that loads" in log
    assert "after epoch 1, step 25 (3 steps into epoch 2)" in result.stdout
    assert ("resumed with settings its run did not have: trainer.checkpoint_every_steps=None (was 5); "
            "trainer.max_steps=None (was 27)\n") in log
    assert_bitwise_equal(tmp_path / "run", runs("straight"))


@pytest.mark.slow
def test_a_run_stopped_mid_epoch_refuses_another_batch_size_in_one_line(tmp_path: Path, runs: LazyRuns):
    """Its place in the epoch is counted in steps: 5 steps of 32 samples would put it 160 samples short of where the 5
    steps of 64 left it, and those samples would be trained on twice. Its checkpoints stay as they were."""
    shutil.copytree(runs("stopped"), tmp_path / "run")
    checkpoints = tmp_path / "run" / "checkpoints"
    saved = {path.name: hashlib.sha256(path.read_bytes()).digest() for path in checkpoints.iterdir()}
    result = train([*TWO_EPOCHS, "dataset.batch_size=32", "resume=auto", "hydra.run.dir=run"], tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        "error: dataset.batch_size=32 cannot resume a run stopped 5 steps into epoch 2 at dataset.batch_size=64 (its "
        "place in the epoch is counted in steps): resume with dataset.batch_size=64"]
    assert {path.name: hashlib.sha256(path.read_bytes()).digest() for path in checkpoints.iterdir()} == saved


@pytest.fixture(scope="module")
def straight_two_ranks(runs: LazyRuns) -> Path:
    return runs("straight on 2")


@pytest.mark.slow
def test_two_ranks_resume_from_the_file_rank_0_chose(tmp_path: Path, runs: LazyRuns, straight_two_ranks: Path):
    shutil.copytree(runs("stopped on 2"), tmp_path / "run")
    damage(tmp_path / "run" / "checkpoints")
    check(torchrun(2, [*TWO_EPOCHS, "resume=auto", "hydra.run.dir=run"], tmp_path))
    log = (tmp_path / "run" / "train.log").read_text()
    assert f"continuing from {tmp_path / 'run' / 'checkpoints' / 'step_000000025.pt'}" in log
    assert_bitwise_equal(tmp_path / "run", straight_two_ranks)


@pytest.mark.slow
def test_a_torchrun_restart_after_a_damaged_last_checkpoint_ends_as_if_never_interrupted(
        tmp_path: Path, straight_two_ranks: Path):
    """No resume= anywhere: rank 1 damages last.pt and step 25 and dies at step 28; torchrun
    restarts the group, which goes on from step 20 by itself."""
    damaging = str(REPO / "tests" / "fixtures" / "damaging_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
               damaging, *TWO_EPOCHS, "trainer.checkpoint_every_steps=5", "hydra.run.dir=run"]
    check(run(command, tmp_path))
    log = (tmp_path / "run" / "train.log").read_text()
    checkpoints = tmp_path / "run" / "checkpoints"
    assert f"resume: skipping a damaged checkpoint: checkpoint {checkpoints / 'last.pt'} cannot be read" in log
    assert f"checkpoint {checkpoints / 'step_000000025.pt'} cannot be read" in log
    assert f"resumed from {checkpoints / 'step_000000020.pt'} after epoch 0, step 20" in log
    assert_bitwise_equal(tmp_path / "run", straight_two_ranks)


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.slow
def test_a_rank_that_cannot_see_the_chosen_checkpoint_stops_every_rank_before_any_step(tmp_path: Path,
                                                                                      stopped: Path):
    """Two "nodes" with their own disks: each rank launched by hand (as a cluster launcher would)
    from its own folder, and only node A's holds the run's checkpoints."""
    node_a, node_b = tmp_path / "a", tmp_path / "b"
    node_b.mkdir()
    shutil.copytree(stopped, node_a / "run")
    before = digests(node_a / "run" / "checkpoints")
    port = free_port()
    ranks = []
    for rank, node in enumerate((node_a, node_b)):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        ranks.append(subprocess.Popen([sys.executable, TRAIN, *TWO_EPOCHS, "resume=auto", "hydra.run.dir=run"],
                                      cwd=node, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [process.communicate(timeout=120) for process in ranks]

    assert [process.returncode for process in ranks] == [2, 2], outputs
    errors = [[line for line in err.splitlines() if line.startswith("error:")] for _, err in outputs]
    (error,) = errors[0]
    last_a, last_b = (node / "run" / "checkpoints" / "last.pt" for node in (node_a, node_b))
    assert error == (f"error: rank 1 cannot load {last_a}, the checkpoint rank 0 resumes from (checkpoint {last_b} "
                     "does not exist); every rank must see the run dir: put hydra.run.dir on a filesystem all "
                     "nodes share")
    assert errors[1] == [] and not any("Traceback" in err for _, err in outputs)
    assert digests(node_a / "run" / "checkpoints") == before
    assert "resumed from" not in (node_a / "run" / "train.log").read_text()  # stopped before any step
