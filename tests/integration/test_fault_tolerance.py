"""A worker killed mid-run: torchrun restarts the group, the run continues from its last
checkpoint in the same run dir, and ends exactly where an uninterrupted run ends. A damaged newest checkpoint:
`resume=auto` goes on from the newest one that loads and ends exactly where an uninterrupted run ends; the ranks
resume from one file chosen by rank 0, or none of them trains at all. The runs the tests compare with or resume
share launches (LazyRuns: one for the 1-process runs, one for the 2-rank runs)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, TRAIN, TWO_THREADS, check, copy_run, free_port, metrics, run, torchrun, train, weights
from lazy_runs import LazyRuns

pytestmark = pytest.mark.slow

ARGS = ["trainer.epochs=3", "optimizer=sgd", "scheduler=constant"]
TIMING_KEYS = {"epoch_time_s", "samples_per_s"}


def worker_pid(agent_pid: int, rank: int) -> int | None:
    """The pid of the worker with RANK=rank that torchrun process `agent_pid` started."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        parent = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        if parent == agent_pid and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def wait_for_epoch(outputs: Path, epoch: int, timeout: float = 120) -> Path:
    """The run dir under `outputs` once its metrics.json reports `epoch`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for path in outputs.glob("*/*/metrics.json"):
            try:
                if json.loads(path.read_text())["epoch"] >= epoch:
                    return path.parent
            except (OSError, ValueError):
                pass
        time.sleep(0.05)
    raise TimeoutError(f"no run under {outputs} reached epoch {epoch}")


def without_timing(summary: dict) -> dict:
    history = [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in summary["history"]]
    return {**{k: v for k, v in summary.items() if k not in TIMING_KEYS}, "history": history}


# A small, stable LR: float noise from a different world size stays at float-noise size.
TWO_EPOCHS = ["trainer.epochs=2", "optimizer=sgd", "optimizer.lr=0.01", "scheduler=constant"]
STOPPED = [*TWO_EPOCHS, "trainer.checkpoint_every_steps=5", "trainer.max_steps=27"]
# The runs the tests compare with or resume, launched together on first use, by number of processes (LazyRuns).
RUNS: dict[str, tuple[int, list[str]]] = {
    # One process (2 threads: conftest.TWO_THREADS), two epochs, never interrupted: what every interrupted run
    # must end as.
    "straight": (1, TWO_EPOCHS),
    "stopped": (1, STOPPED),  # stopped at step 27 with step checkpoints every 5 steps (25 and 27 kept)
    "straight on 2, 3 epochs": (2, ARGS),
    "straight on 2": (2, TWO_EPOCHS),
    "stopped on 2": (2, STOPPED),
    "stopped on 2 at step 27": (2, [*TWO_EPOCHS, "trainer.max_steps=27"]),
    "stopped on 2 at step 30": (2, [*TWO_EPOCHS, "trainer.max_steps=30"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> LazyRuns:
    return LazyRuns(tmp_path_factory.mktemp("fault_tolerance"), RUNS)


def test_a_killed_worker_is_restarted_and_the_run_ends_as_if_never_interrupted(workdir: Path, runs: LazyRuns):
    straight = runs("straight on 2, 3 epochs")

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "--max-restarts=2", TRAIN, *ARGS]
    agent = subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    run_dir = wait_for_epoch(workdir / "outputs", 1)  # epoch 1 is checkpointed; epoch 2 is under way
    victim = worker_pid(agent.pid, rank=1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    out, err = agent.communicate(timeout=300)
    assert agent.returncode == 0, err[-3000:]

    log = (run_dir / "train.log").read_text()
    assert "resumed from" in log and "after epoch" in log  # the restarted group resumed by itself
    assert list((workdir / "outputs").glob("*/*")) == [run_dir]  # the restart kept its run dir
    assert without_timing(metrics(run_dir)) == without_timing(metrics(straight))
    for name, tensor in weights(straight).items():
        assert torch.equal(tensor, weights(run_dir)[name]), name


@pytest.fixture(scope="module")
def straight(runs: LazyRuns) -> Path:
    return runs("straight")


def assert_same_run(run_dir: Path, reference: Path, atol: float = 0.0) -> None:
    if not atol:
        assert without_timing(metrics(run_dir))["history"] == without_timing(metrics(reference))["history"]
    for name, tensor in weights(reference).items():
        if atol:
            assert torch.allclose(tensor.double(), weights(run_dir)[name].double(), rtol=0, atol=atol), name
        else:
            assert torch.equal(tensor, weights(run_dir)[name]), name


def test_a_step_checkpoint_resumes_mid_epoch_exactly(workdir: Path, runs: LazyRuns, straight: Path):
    assert "stopped at step 27 with a checkpoint" in (runs("stopped") / "train.log").read_text()
    copy_run(runs("stopped"), workdir / "run")
    checkpoints = sorted(p.name for p in (workdir / "run" / "checkpoints").iterdir())
    assert checkpoints == ["best.pt", "last.pt", "step_000000025.pt", "step_000000027.pt"]  # keep_last=2
    saved = torch.load(workdir / "run" / "checkpoints" / "last.pt", weights_only=True)["loop"]
    assert (saved["epoch"], saved["step"], saved["step_in_epoch"]) == (1, 27, 5)
    assert saved["epoch_totals"]["count"] == [5 * 64]  # the unfinished epoch's samples so far, by name
    second = check(train([*TWO_EPOCHS, "resume=auto", "hydra.run.dir=run"], workdir, env=TWO_THREADS))
    assert "after epoch 1, step 27 (5 steps into epoch 2)" in second.stdout
    assert_same_run(workdir / "run", straight)


def test_a_run_resumes_on_another_world_size(workdir: Path, straight: Path, runs: LazyRuns):
    copy_run(runs("stopped on 2 at step 27"), workdir / "run")
    saved = torch.load(workdir / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert saved["config"]["trainer"]["max_steps"] == 27 and saved["loop"]["step"] == 27
    # Now one process, for 3 steps: within rounding of the 2-rank run, compared before one step can turn rounding
    # into more (a value crossing a ReLU's kink: test_fsdp_cli.py's TWO_EPOCHS; against the 1-process run here:
    # 1.5e-7 at step 31, 2.4e-6 at 34, 5e-5 at the end; Intel Xeon, 2026-11-27).
    check(train([*TWO_EPOCHS, "trainer.max_steps=30", "resume=auto", "hydra.run.dir=run"], workdir, env=TWO_THREADS))
    saved = torch.load(workdir / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert saved["loop"]["step"] == 30 and metrics(workdir / "run")["world_size"] == 1
    assert_same_run(workdir / "run", runs("stopped on 2 at step 30"), atol=1e-5)
    check(train([*TWO_EPOCHS, "resume=auto", "hydra.run.dir=run"], workdir, env=TWO_THREADS))  # on to the end
    summary = metrics(workdir / "run")
    assert summary["world_size"] == 1 and summary["step"] == 44
    # Same global batches in the same order: only float rounding (sync-BN on 2 ranks) differs,
    # which may flip a borderline prediction, so train/acc is compared to a sample or two.
    assert summary["train/acc"] == pytest.approx(metrics(straight)["train/acc"], abs=2 / 1408)


def test_sigterm_checkpoints_and_stops_cleanly(workdir: Path, straight: Path):
    command = [sys.executable, TRAIN, *TWO_EPOCHS, "trainer.log_every_steps=2", "hydra.run.dir=run"]
    process = subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **TWO_THREADS})
    deadline = time.time() + 120
    while not (workdir / "run" / "metrics.json").exists() and time.time() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)  # during epoch 2
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err[-2000:]
    assert "SIGTERM: checkpointing at the next log step" in err + out
    assert "stopped at step" in out
    saved = torch.load(workdir / "run" / "checkpoints" / "last.pt", weights_only=True)["loop"]
    assert saved["epoch"] == 1 and 22 < saved["step"] < 44 and saved["step"] % 2 == 0
    check(train([*TWO_EPOCHS, "resume=auto", "hydra.run.dir=run"], workdir, env=TWO_THREADS))
    assert_same_run(workdir / "run", straight)


def test_a_corrupt_last_checkpoint_is_refused_and_left_alone(workdir: Path, one_epoch_run: Path):
    copy_run(one_epoch_run, workdir / "run")
    last = workdir / "run" / "checkpoints" / "last.pt"
    last.write_bytes(last.read_bytes()[:1000])  # as if the disk filled up under another tool
    damaged = last.read_bytes()
    result = train(["trainer.epochs=2", "resume=auto", "hydra.run.dir=run"], workdir)
    assert result.returncode == 2
    assert f"error: checkpoint {last} cannot be read" in result.stderr and "Traceback" not in result.stderr
    assert last.read_bytes() == damaged
    assert metrics(workdir / "run")["epoch"] == 1


WRITER = """
import sys, torch
sys.path.insert(0, {repo!r})
from pathlib import Path
from src.checkpoint.file_store import FileStore
saver = FileStore(Path({directory!r}), is_main_process=True, background={background})
saver.save({{"model": {{"w": torch.zeros(3)}}, "loop": {{"epoch": 1}}}}, step=1, is_best=False)
saver.wait()
print("first saved", flush=True)
saver.save({{"model": {{"w": torch.ones(64 * 2**20)}}, "loop": {{"epoch": 2}}}}, step=2, is_best=False)  # 256 MB: slow
saver.wait()
"""


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async_checkpoint"])
def test_a_process_killed_while_writing_leaves_the_previous_checkpoint(tmp_path: Path, background: bool):
    """Killed while the second save is being written (with trainer.async_checkpoint: by the writer thread)."""
    from conftest import REPO

    from src import checkpoint

    code = WRITER.format(repo=str(REPO), directory=str(tmp_path), background=background)
    writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "first saved"
    temp = tmp_path / "last.pt.tmp"
    deadline = time.time() + 60
    while not (temp.exists() and temp.stat().st_size > 0) and time.time() < deadline:
        time.sleep(0.001)
    writer.kill()  # mid-write of the second checkpoint
    writer.wait(timeout=30)
    assert checkpoint.read(tmp_path / "last.pt").loop["epoch"] == 1


def test_sigterm_to_torchrun_checkpoints_every_rank_at_the_same_step(workdir: Path, runs: LazyRuns):
    """SLURM and schedulers signal the launcher; torchrun forwards SIGTERM to its workers,
    which agree on one step, write one checkpoint and exit before torchrun's grace period ends."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", TRAIN,
               *TWO_EPOCHS, "trainer.log_every_steps=2", "hydra.run.dir=run"]
    agent = subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (workdir / "run" / "metrics.json").exists() and time.time() < deadline:
        time.sleep(0.02)
    agent.send_signal(signal.SIGTERM)
    agent.communicate(timeout=120)
    saved = torch.load(workdir / "run" / "checkpoints" / "last.pt", weights_only=True)["loop"]
    assert saved["epoch"] == 1 and 22 < saved["step"] < 44 and saved["step"] % 2 == 0
    assert "stopped at step" in (workdir / "run" / "train.log").read_text()
    check(torchrun(2, [*TWO_EPOCHS, "resume=auto", "hydra.run.dir=run"], workdir))
    assert_same_run(workdir / "run", runs("straight on 2"))


# -- a damaged newest checkpoint -------------------------------------------------------------------


def damage(checkpoints: Path) -> None:
    """The two newest states unreadable: last.pt cut short, step 27 empty; step 25 is intact."""
    last = checkpoints / "last.pt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    (checkpoints / "step_000000027.pt").write_bytes(b"")


def assert_bitwise_equal(run_dir: Path, reference: Path) -> None:
    assert without_timing(metrics(run_dir)) == without_timing(metrics(reference))
    for name, tensor in weights(reference).items():
        assert torch.equal(tensor, weights(run_dir)[name]), name


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


def test_two_ranks_resume_from_the_file_rank_0_chose(tmp_path: Path, runs: LazyRuns):
    shutil.copytree(runs("stopped on 2"), tmp_path / "run")
    damage(tmp_path / "run" / "checkpoints")
    check(torchrun(2, [*TWO_EPOCHS, "resume=auto", "hydra.run.dir=run"], tmp_path))
    log = (tmp_path / "run" / "train.log").read_text()
    assert f"continuing from {tmp_path / 'run' / 'checkpoints' / 'step_000000025.pt'}" in log
    assert_bitwise_equal(tmp_path / "run", runs("straight on 2"))


def test_a_torchrun_restart_after_a_damaged_last_checkpoint_ends_as_if_never_interrupted(tmp_path: Path,
                                                                                        runs: LazyRuns):
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
    assert_bitwise_equal(tmp_path / "run", runs("straight on 2"))


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_a_rank_that_cannot_see_the_chosen_checkpoint_stops_every_rank_before_any_step(tmp_path: Path,
                                                                                      runs: LazyRuns):
    """Two "nodes" with their own disks: each rank launched by hand (as a cluster launcher would)
    from its own folder, and only node A's holds the run's checkpoints."""
    node_a, node_b = tmp_path / "a", tmp_path / "b"
    node_b.mkdir()
    shutil.copytree(runs("stopped"), node_a / "run")
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
