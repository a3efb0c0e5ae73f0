"""Hydra x launchers, end to end: self-launch, sweeps of DDP groups, torchrun sweeps, submitit,
multi-node rendezvous, crashes and the sweep summary."""

from __future__ import annotations

import csv
import hashlib
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TRAIN, check, free_port, metrics, run, torchrun, train
from faults import descendants, is_alive, wait_for_epoch, wait_until

pytestmark = pytest.mark.slow

TIMING_KEYS = {"epoch_time_s", "samples_per_s"}


def history_without_timing(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in metrics(run_dir)["history"]]


def job_dirs(sweep: Path) -> list[Path]:
    return sorted((p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def summary_rows(sweep: Path) -> list[dict]:
    with open(sweep / "summary.csv") as file:
        return list(csv.DictReader(file))


def test_workers_die_with_a_launcher_killed_outright_and_write_nothing_after(workdir: Path, launched):
    """SIGKILL to the process that started `dist.nproc_per_node=2` workers (as when a sweep's process is
    killed): torch's launcher put each worker in a session of its own, yet they end with it
    (workers.die_with_launcher), instead of training on into a run dir a resumed run continues in."""
    run_dir = workdir / "run"
    launcher = launched.start([sys.executable, TRAIN, "dist.nproc_per_node=2", "trainer.epochs=100",
                               "trainer.progress=false", "hydra.run.dir=run"], workdir)
    wait_for_epoch(run_dir, 1)
    workers = descendants(launcher.pid)
    assert len(workers) >= 2, workers
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=30)
    try:
        wait_until(lambda: not any(is_alive(pid) for pid in workers), 10, "the workers to end with their launcher")
    finally:  # orphans of a failed check must not train on for 100 epochs
        for pid in filter(is_alive, workers):
            os.kill(pid, signal.SIGKILL)
    written = {path: hashlib.sha256(path.read_bytes()).digest() for path in run_dir.rglob("*") if path.is_file()}
    time.sleep(2)
    assert {path: hashlib.sha256(path.read_bytes()).digest()
            for path in run_dir.rglob("*") if path.is_file()} == written  # nobody writes there any more
    assert metrics(run_dir)["epoch"] < 100


def test_self_launched_workers_stopped_before_the_first_validation_end_cleanly(workdir: Path):
    """max_steps ends the workers before any metrics.json: the launcher exits 0 (its result is NaN, as a
    one-process run's), and the command it prints continues the run: the same settings and launch, to the end."""
    result = check(train(["dist.nproc_per_node=2", "trainer.epochs=1", "trainer.max_steps=2", "hydra.run.dir=run"],
                         workdir))
    assert "Traceback" not in result.stderr and not (workdir / "run" / "metrics.json").exists()
    assert (workdir / "run" / "checkpoints" / "last.pt").exists()
    hint = result.stdout.split("stopped at step 2 with a checkpoint; continue with: ")[1].splitlines()[0]
    assert shlex.split(hint) == ["dist.nproc_per_node=2", "trainer.epochs=1", "resume=auto",
                                 f"hydra.run.dir={workdir / 'run'}"]  # all but the max_steps it stopped at
    resumed = check(train(shlex.split(hint), workdir))
    assert "resumed with settings its run did not have: trainer.max_steps=None (was 2)\n" in resumed.stdout
    assert metrics(workdir / "run")["world_size"] == 2 and metrics(workdir / "run")["step"] == 22


def test_sweep_of_ddp_groups(workdir: Path):
    args = ["-m", "dist.nproc_per_node=2", "optimizer=sgd,adam", "trainer.epochs=1", "hydra.sweep.dir=sweep"]
    (workdir / "tmp").mkdir()
    result = check(train(args, workdir, timeout=600, env={"TMPDIR": str(workdir / "tmp")}))
    # No launcher's dir left behind, one per job (torch's own cache, torchinductor_USER, may be there).
    assert list((workdir / "tmp").glob("torchelastic_*")) == []
    jobs = job_dirs(workdir / "sweep")
    assert [p.name for p in jobs] == ["0", "1"]
    for job in jobs:
        summary = metrics(job)
        assert summary["world_size"] == 2 and summary["epoch"] == 1
        assert (job / "checkpoints" / "last.pt").exists() and (job / "train.rank1.log").exists()
        assert len(list((job / "tb").glob("events.out.tfevents*"))) == 1
    rows = summary_rows(workdir / "sweep")
    assert len(rows) == 2 and {r["status"] for r in rows} == {"completed"}
    accuracies = [float(r["val/acc"]) for r in rows]
    assert accuracies == sorted(accuracies, reverse=True)
    by_job = {r["job"]: r for r in rows}
    assert by_job["1"]["overrides"] == "dist.nproc_per_node=2 optimizer=adam trainer.epochs=1"
    assert float(by_job["1"]["val/acc"]) == metrics(jobs[1])["val/acc"]
    assert "Sweep summary (sorted by val/acc, max)" in result.stdout and "| job | status |" in result.stdout
    assert (workdir / "sweep" / "summary.md").read_text().count("| completed |") == 2


def test_torchrun_runs_a_sweep(workdir: Path):
    check(torchrun(2, ["-m", "optimizer.lr=0.1,0.01", "trainer.epochs=1", "hydra.sweep.dir=sweep"], workdir))
    jobs = job_dirs(workdir / "sweep")
    assert [p.name for p in jobs] == ["0", "1"]
    assert [metrics(job)["world_size"] for job in jobs] == [2, 2]
    assert len(list((workdir / "sweep").rglob("config.yaml"))) == 2  # rank 0's only
    assert [r["status"] for r in summary_rows(workdir / "sweep")] == ["completed", "completed"]


BATCH_63 = ("error: dataset.batch_size=63 is the global batch and must be divisible by world_size x trainer.grad_accum "
            "= 2 x 1 = 2")


def test_a_failing_job_is_reported_and_the_sweep_goes_on(workdir: Path):
    # 63 does not divide over 2 ranks: job 0 stops on a usage error, job 1 trains.
    args = ["-m", "dist.nproc_per_node=2", "dataset.batch_size=63,64", "trainer.epochs=1", "hydra.sweep.dir=sweep"]
    (workdir / "tmp").mkdir()
    result = train(args, workdir, env={"TMPDIR": str(workdir / "tmp")})
    assert result.returncode != 0 and list((workdir / "tmp").glob("torchelastic_*")) == []
    assert "error: dataset.batch_size=63 is the global batch and must be divisible" in result.stderr
    # As the sweep ends, Hydra names the failed job and prints its error as one line, not as a traceback.
    assert "Traceback" not in result.stderr
    assert error_lines(result.stderr)[-1] == BATCH_63  # the workers' line: the launching process read their record
    rows = {r["job"]: r for r in summary_rows(workdir / "sweep")}
    assert rows["0"]["status"] == "failed" and rows["1"]["status"] == "completed"
    assert (workdir / "sweep" / "0" / "FAILED").read_text().strip() == f"UsageError: {BATCH_63}"
    assert metrics(workdir / "sweep" / "1")["world_size"] == 2


def test_a_crash_after_another_job_s_usage_error_keeps_its_own_traceback(workdir: Path):
    """Job 0's workers record their usage error for their group; job 1's workers, launched by the same process,
    crash (a well-typed model option its class cannot build: a negative input width) and report that, not job 0's error
    as their peer's."""
    args = ["-m", "dist.nproc_per_node=2", "dataset.batch_size=63,64", "model.in_channels=-1", "hydra.sweep.dir=crash"]
    result = train(args, workdir)
    assert result.returncode == 1
    crash = "Error in call to target 'src.components.models.SimpleCNN':\nRuntimeError("
    assert result.stderr.count(crash) == 2 and "a peer stopped" not in result.stderr  # each worker's own report
    failed = (workdir / "crash" / "1" / "FAILED").read_text()  # the launcher's: with the workers' tracebacks
    assert failed.startswith("ChildFailedError") and "Traceback (most recent call last)" in failed \
        and crash.split("\n")[0] in failed
    assert error_lines(result.stderr) == [BATCH_63, BATCH_63]  # job 0's line: as it stopped, and as the sweep ended


def test_a_job_s_usage_error_in_a_one_process_sweep_is_its_line_and_the_sweep_goes_on(workdir: Path):
    args = ["-m", "optimizer.lr=-1,0.1,-2", "trainer.epochs=1", "trainer.limit_train_batches=2",
            "trainer.limit_val_batches=1", "hydra.sweep.dir=sweep"]
    result = train(args, workdir)
    assert result.returncode == 1 and "Traceback" not in result.stderr  # Hydra's code for a failed sweep
    first, second = "error: optimizer.lr=-1 must be a number >= 0", "error: optimizer.lr=-2 must be a number >= 0"
    # Each failed job's line as it stops; as the sweep ends, Hydra names the first failed job and prints its line.
    assert error_lines(result.stderr) == [first, second, first]
    assert "Error executing job with overrides: ['optimizer.lr=-1'" in result.stderr
    rows = {r["job"]: r["status"] for r in summary_rows(workdir / "sweep")}
    assert rows == {"0": "failed", "1": "completed", "2": "failed"}
    assert (workdir / "sweep" / "2" / "FAILED").read_text() == f"UsageError: {second}\n"
    assert metrics(workdir / "sweep" / "1")["step"] == 2
    assert "Sweep summary (sorted by val/acc, max)" in result.stdout  # printed after a failed job too


# A fork's task whose job crashes at its second step where `crash` is set; each job's first step prints how many
# earlier jobs' models are still alive (held by a failed job's error or left in reference cycles), then adds its own.
PROBE = """
import weakref
from src.components.tasks import Classification

EARLIER = []


class Probe(Classification):
    def __init__(self, *args, crash=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.crash, self.steps = crash, 0

    def train_step(self, step):
        self.steps += 1
        if self.steps == 1:
            print("earlier models alive:", sum(ref() is not None for ref in EARLIER), flush=True)
            EARLIER.append(weakref.ref(step.modules["model"]))
        if self.crash and self.steps == 2:
            raise RuntimeError("a fork's step crashed")
        return super().train_step(step)
"""


def test_each_job_of_a_one_process_sweep_frees_its_model_before_the_next_job_however_it_ended(workdir: Path):
    """A sweep's jobs run in its process, one after another: each job's model and optimizer state (on a GPU: the
    memory the next job needs) are freed as it ends, after a crash as after a completed job."""
    (workdir / "forkprobe.py").write_text(PROBE)
    args = ["-m", "task._target_=forkprobe.Probe", "+task.crash=true,false,false", "trainer.epochs=1",
            "trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "hydra.sweep.dir=probed"]
    result = train(args, workdir, env={"PYTHONPATH": str(workdir)})
    assert result.returncode == 1 and "RuntimeError: a fork's step crashed" in result.stderr
    assert [line for line in result.stdout.splitlines() if line.startswith("earlier models alive:")] == [
        "earlier models alive: 0"] * 3
    assert {r["job"]: r["status"] for r in summary_rows(workdir / "probed")} == {
        "0": "failed", "1": "completed", "2": "completed"}


def test_a_crashing_worker_ends_its_group_with_its_traceback(workdir: Path):
    crashing = str(REPO / "tests" / "fixtures" / "crashing_worker.py")
    # The whole group must be gone within 60 s of starting (a hang would hit this bound).
    result = torchrun(2, ["trainer.epochs=3", "hydra.run.dir=run"], workdir, script=crashing, timeout=60)
    assert result.returncode != 0
    assert "RuntimeError: injected failure on rank 1 at step 3" in result.stderr
    assert "Root Cause" in result.stderr and "rank      : 1" in result.stderr
    assert not (workdir / "run" / "metrics.json").exists()


def test_submitit_tasks_form_one_ddp_group(workdir: Path):
    # Submitit pickles the task by reference to `src`, so launch from the repo root as the README says.
    args = [TRAIN, "-m", "hydra/launcher=local_ddp", "trainer.epochs=1", f"hydra.sweep.dir={workdir / 'sweep'}"]
    check(run([sys.executable, *args], REPO, timeout=400))
    jobs = job_dirs(workdir / "sweep")
    assert [p.name for p in jobs] == ["0"]
    assert metrics(jobs[0])["world_size"] == 2
    assert (jobs[0] / "train.rank1.log").exists()
    assert len(list((workdir / "sweep").rglob("config.yaml"))) == 1


def test_two_torchrun_agents_train_as_one_group(workdir: Path):
    endpoint = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=two-nodes", TRAIN,
               "trainer.epochs=1"]
    agents = [subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    outputs = [agent.communicate(timeout=300) for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    run_dirs = [p for p in (workdir / "outputs").glob("*/*") if p.is_dir()]
    assert len(run_dirs) == 1
    assert metrics(run_dirs[0])["world_size"] == 2 and (run_dirs[0] / "train.rank1.log").exists()
