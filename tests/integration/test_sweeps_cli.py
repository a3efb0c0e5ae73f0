"""Sweeps through the real command line: an Optuna study whose trials are 2-rank DDP groups, pruning,
sweeps killed and run again (grid and Optuna), and the sweepers' usage errors.

What lands in the sweep dir is checked against optuna.db, each job's metrics.json and checkpoints,
and each rank's log (every rank logs the resolved config it trains with).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch
import yaml
from conftest import REPO, TRAIN, check, metrics, run, train, weights
from faults import descendants

pytestmark = pytest.mark.slow

SHORT = ["trainer.epochs=3", "trainer.limit_train_batches=3", "trainer.limit_val_batches=1"]
# 4 trials of 2 ranks; lr up to 10 holds a bad region, and the median pruner judges from the first epoch
# once one trial has finished.
DDP_STUDY = ["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=4", "hydra.sweeper.seed=0",
             "hydra.sweeper.pruner=median", "hydra.sweeper.pruner_startup_trials=1",
             "hydra.sweeper.pruner_warmup_epochs=0", "optimizer.lr=tag(log,interval(1e-4,10))", "optimizer=sgd",
             "dist.nproc_per_node=2", *SHORT, "hydra.sweep.dir=sweep"]


FORK_CONF = "hydra.searchpath=[file://fork_conf]"  # relative to the sweep's working dir


def load_study(sweep_dir: Path) -> optuna.Study:
    return optuna.load_study(study_name="sweep", storage=f"sqlite:///{sweep_dir / 'optuna.db'}")


def logged_config(log_file: Path) -> dict:
    """The resolved config a rank logged at its start (the YAML under its `config:` line)."""
    lines = log_file.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith("config:")) + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("["))
    return yaml.safe_load("\n".join(lines[start:end]))


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def ddp_study(tmp_path_factory) -> tuple[Path, str]:
    """The sweep dir of an Optuna study of 4 two-rank trials with a median pruner, and the sweep's stdout; as a
    fork's, its optimizer config is in a config folder of its own."""
    workdir = tmp_path_factory.mktemp("ddp_study")
    (workdir / "fork_conf" / "optimizer").mkdir(parents=True)
    shutil.copy(REPO / "conf" / "optimizer" / "sgd.yaml", workdir / "fork_conf" / "optimizer" / "fork_sgd.yaml")
    args = ["optimizer=fork_sgd" if arg == "optimizer=sgd" else arg for arg in DDP_STUDY]
    result = check(train([*args, FORK_CONF], workdir, timeout=600))
    return workdir / "sweep", result.stdout


def test_the_study_in_optuna_db_holds_each_two_rank_jobs_result(ddp_study):
    sweep_dir, _ = ddp_study
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0", "1", "2", "3"]
    trials = load_study(sweep_dir).trials
    assert [t.state.name in ("COMPLETE", "PRUNED") for t in trials] == [True] * 4
    assert [t.user_attrs["job"] for t in trials] == [0, 1, 2, 3]
    for trial in trials:
        job_metrics = metrics(sweep_dir / str(trial.user_attrs["job"]))
        assert job_metrics["world_size"] == 2
        assert trial.value == job_metrics["val/acc"]  # what train.py returned: the monitored metric


def test_both_ranks_of_a_trial_trained_with_the_values_optuna_sampled(ddp_study):
    sweep_dir, _ = ddp_study
    for trial in load_study(sweep_dir).trials:
        job_dir = sweep_dir / str(trial.user_attrs["job"])
        rank0, rank1 = logged_config(job_dir / "train.log"), logged_config(job_dir / "train.rank1.log")
        assert rank0 == rank1
        assert rank0["optimizer"]["lr"] == trial.params["optimizer.lr"]
        saved = torch.load(job_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)["config"]
        assert saved["optimizer"]["lr"] == trial.params["optimizer.lr"]


def test_a_pruned_trial_stops_every_rank_after_the_same_epoch_with_a_checkpoint(ddp_study):
    sweep_dir, _ = ddp_study
    pruned = [t for t in load_study(sweep_dir).trials if t.state.name == "PRUNED"]
    assert pruned, "the bad region of the search space pruned no trial"
    for trial in pruned:
        job_dir = sweep_dir / str(trial.user_attrs["job"])
        job_metrics = metrics(job_dir)
        epoch = job_metrics["stopped_at_epoch"]
        assert job_metrics["stop_reason"] == "pruned" and epoch == job_metrics["epoch"] < 3
        assert max(trial.intermediate_values) == epoch  # rank 0 reported each epoch up to the decision
        saved = torch.load(job_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)["loop"]
        assert saved["epoch"] == epoch and (saved["ended"]["reason"], saved["ended"]["epoch"]) == ("pruned", epoch)
        line = f"pruned after epoch {epoch}: the sweep's pruner stopped this trial"
        assert line in (job_dir / "train.log").read_text() and line in (job_dir / "train.rank1.log").read_text()


def test_the_summary_shows_states_pruned_epochs_and_the_best_command(ddp_study):
    sweep_dir, stdout = ddp_study
    study = load_study(sweep_dir)
    rows = {line.split(",")[0]: line.split(",") for line in (sweep_dir / "summary.csv").read_text().splitlines()}
    header = rows.pop("job")
    for trial in study.trials:
        row = dict(zip(header, rows[str(trial.user_attrs["job"])]))
        assert row["status"] == {"COMPLETE": "completed", "PRUNED": "pruned"}[trial.state.name]
        epoch = metrics(sweep_dir / row["job"]).get("stopped_at_epoch")
        assert row["pruned_epoch"] == ("" if trial.state.name == "COMPLETE" else str(epoch))
    best = study.best_trial
    command = "python train.py " + shlex.join([FORK_CONF, *best.user_attrs["overrides"]])
    assert f"Best job ({best.user_attrs['job']}), trained again by:\n\n    {command}\n" in (
        sweep_dir / "summary.md").read_text()
    assert command in stdout
    again = check(train([*shlex.split(command)[2:], "--cfg", "job"], sweep_dir.parent))  # it finds the fork's config
    assert yaml.safe_load(again.stdout)["optimizer"]["lr"] == best.params["optimizer.lr"]


def test_optuna_trials_run_by_the_submitit_launcher_are_groups_of_two_tasks_with_the_same_values(tmp_path: Path):
    # Submitit pickles the task by reference to `src`: launched from the repo root, as the README says.
    sweep_dir = tmp_path / "sweep"
    args = [arg for arg in DDP_STUDY[:-1] if arg not in ("dist.nproc_per_node=2", "hydra.sweeper.n_trials=4")]
    args = [*args, "hydra/launcher=local_ddp", "hydra.sweeper.n_trials=2", f"hydra.sweep.dir={sweep_dir}"]
    check(run([sys.executable, TRAIN, *args], REPO, timeout=600))
    trials = load_study(sweep_dir).trials
    assert [t.state.name for t in trials] == ["COMPLETE", "PRUNED"]  # the first two trials of `ddp_study`
    # Each job's ranks met on the port its rank 0 published in the job's submitit folder.
    assert len(list((sweep_dir / ".submitit").glob("*/*_master_port"))) == 2
    for trial in trials:
        job_dir = sweep_dir / str(trial.user_attrs["job"])
        rank0, rank1 = logged_config(job_dir / "train.log"), logged_config(job_dir / "train.rank1.log")
        assert rank0 == rank1 and rank0["optimizer"]["lr"] == trial.params["optimizer.lr"]
        assert metrics(job_dir)["world_size"] == 2


def start_sweep(args: list[str], workdir: Path) -> subprocess.Popen:
    """The sweep in its own process group: the sweeper and every worker it starts can be killed at once."""
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.Popen([sys.executable, TRAIN, *args], cwd=workdir, start_new_session=True,
                            stdout=open(workdir / "killed.out", "w"), stderr=subprocess.STDOUT,
                            env={**env, "PYTHONUNBUFFERED": "1"})


def kill_during_job(process: subprocess.Popen, job_dir: Path) -> None:
    """SIGKILL the sweep once `job_dir` holds a step checkpoint (the job is mid-epoch): the sweeper's process
    group, and the workers torch's launcher started in sessions of their own."""
    deadline = time.time() + 300
    try:
        while not list((job_dir / "checkpoints").glob("step_*.pt")):
            assert process.poll() is None and time.time() < deadline, (job_dir.parent.parent / "killed.out").read_text()
            time.sleep(0.02)
    finally:
        for pid in [*descendants(process.pid), process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def assert_resumed_and_bitwise_equal_to_a_straight_run(job_dir: Path, workdir: Path) -> None:
    """The job continued from its checkpoint and ended with the weights of the same job run straight."""
    resumed_lines = [line for line in (job_dir / "train.log").read_text().splitlines() if "resumed from" in line]
    assert len(resumed_lines) == 1 and f"{job_dir.name}/checkpoints/last.pt after epoch" in resumed_lines[0]
    overrides = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text())
    check(train([*overrides, "hydra.run.dir=straight"], workdir, timeout=600))
    resumed, straight = weights(job_dir), weights(workdir / "straight")
    assert resumed.keys() == straight.keys()
    assert all(torch.equal(resumed[key], straight[key]) for key in resumed)
    assert metrics(job_dir)["val/acc"] == metrics(workdir / "straight")["val/acc"]


def test_an_optuna_sweep_killed_during_trial_3_continues_where_it_stopped(tmp_path: Path):
    args = ["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=4", "hydra.sweeper.sampler=random",
            "hydra.sweeper.seed=1", "optimizer.lr=interval(0.01,0.1)", "optimizer=sgd", "dist.nproc_per_node=2",
            "trainer.epochs=2", "trainer.checkpoint_every_steps=3", "hydra.sweep.dir=sweep"]
    sweep_dir = tmp_path / "sweep"
    kill_during_job(start_sweep(args, tmp_path), sweep_dir / "2")
    finished = {job: digests(sweep_dir / job) for job in ("0", "1")}

    check(train(args, tmp_path, timeout=600))
    assert {job: digests(sweep_dir / job) for job in ("0", "1")} == finished  # not run again
    trials = load_study(sweep_dir).trials
    assert sum(t.state.name == "COMPLETE" for t in trials) == 4 and len(trials) == 5
    dead = [t for t in trials if t.state.name == "FAIL"]
    assert len(dead) == 1 and dead[0].user_attrs == {**dead[0].user_attrs, "job": 2, "died": True}
    again = [t for t in trials if t.state.name == "COMPLETE" and t.user_attrs["job"] == 2]
    assert len(again) == 1 and again[0].params == dead[0].params
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0", "1", "2", "3"]
    assert_resumed_and_bitwise_equal_to_a_straight_run(sweep_dir / "2", tmp_path)


def test_a_grid_sweep_killed_during_job_3_continues_where_it_stopped(tmp_path: Path):
    args = ["-m", "optimizer.lr=0.01,0.02,0.03,0.04", "optimizer=sgd", "trainer.epochs=2",
            "trainer.checkpoint_every_steps=3", "hydra.sweep.dir=sweep"]
    sweep_dir = tmp_path / "sweep"
    kill_during_job(start_sweep(args, tmp_path), sweep_dir / "2")
    finished = {job: digests(sweep_dir / job) for job in ("0", "1")}

    result = check(train(args, tmp_path, timeout=600))
    assert {job: digests(sweep_dir / job) for job in ("0", "1")} == finished
    assert "job 0 (optimizer.lr=0.01 optimizer=sgd trainer.epochs=2 trainer.checkpoint_every_steps=3): completed, " \
           "not run again" in result.stdout + result.stderr
    summary = (sweep_dir / "summary.csv").read_text().splitlines()[1:]
    assert sorted(line.split(",")[:2] for line in summary) == [[str(n), "completed"] for n in range(4)]
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0", "1", "2", "3"]
    assert_resumed_and_bitwise_equal_to_a_straight_run(sweep_dir / "2", tmp_path)


OPTUNA = ["-m", "hydra/sweeper=optuna", "hydra.sweep.dir=sweep"]
BAD_SWEEPS = [
    pytest.param([*OPTUNA, "optimizer.lr=loguniform(1e-4,1e-1)"],
                 "loguniform(...) is not a function of Hydra's override grammar", id="unknown-function"),
    pytest.param([*OPTUNA, "optimizer.lr=glob(*)"], "optimizer.lr names no distribution Optuna can sample",
                 id="not-a-distribution"),
    pytest.param([*OPTUNA, "hydra.sweeper.n_trials=0", "optimizer.lr=interval(0.01,0.1)"],
                 "hydra.sweeper.n_trials=0 must be at least 1", id="no-trials"),
    pytest.param([*OPTUNA, "hydra.sweeper.direction=minimize", "optimizer.lr=interval(0.01,0.1)"],
                 "hydra.sweeper.direction=minimize contradicts trainer.monitor=val/acc, whose trainer.monitor_mode "
                 "is max", id="direction-against-the-monitor"),
    pytest.param([*OPTUNA, "optimizer.lr=interval(0.01,0.5)"], "holds another sweep's study", id="another-study"),
    pytest.param(["-m", "optimizer.lr=0.5,0.6", "hydra.sweep.dir=sweep"], "holds another sweep's job",
                 id="grid-into-a-study's-dir"),
]


@pytest.fixture(scope="module")
def sweep_of_one_trial(tmp_path_factory) -> Path:
    """A finished Optuna sweep of one 1-epoch trial in `sweep/` of the returned workdir."""
    workdir = tmp_path_factory.mktemp("one_trial")
    check(train([*OPTUNA, "hydra.sweeper.n_trials=1", "optimizer.lr=interval(0.01,0.1)", "trainer.epochs=1",
                 "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"], workdir))
    return workdir


@pytest.mark.parametrize("args,message", BAD_SWEEPS)
def test_a_bad_sweep_is_one_error_line_and_touches_nothing(sweep_of_one_trial: Path, args, message):
    before = digests(sweep_of_one_trial)
    result = run([sys.executable, TRAIN, *args], sweep_of_one_trial)
    assert result.returncode == 2, result.stderr[-3000:]
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and message in error_lines[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert digests(sweep_of_one_trial) == before
