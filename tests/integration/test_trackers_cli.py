"""The `logger` group on the real CLI, against real parts: a real `mlflow server` (SQLite store, 127.0.0.1, started
once for the module and stopped at its end), W&B in offline mode (no network: WANDB_MODE and its dirs are set
here), the CSV file. One tracker run per training run through a killed rank's restart, a SIGTERM stop plus
resume=auto and a sweep's jobs; each step once; only rank 0 opens a run; a missing package or a silent server is
one line before any work, leaving nothing behind."""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Iterator

import pytest
import torch
from conftest import TRAIN, check, free_port, train
from faults import descendants, torchrun_command, wait_until, with_env

pytestmark = pytest.mark.slow

WANDB_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}  # never the network
# Two epochs of 12 steps, each step logged; a step checkpoint every 4 steps.
ARGS = ["trainer.epochs=2", "trainer.limit_train_batches=12", "trainer.limit_val_batches=2",
        "trainer.log_every_steps=1", "trainer.checkpoint_every_steps=4", "optimizer=sgd", "scheduler=constant"]
STEPS = list(range(1, 25))


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, subprocess.Popen]]:
    """A real MLflow server with a SQLite store, started when the module's first test asks (it boots while the
    tests that need no server run: see `mlflow_uri`), stopped with its workers at the module's end."""
    store = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    command = [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri",
               f"sqlite:///{store}/mlflow.db", "--artifacts-destination", str(store / "artifacts"),
               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    # Without MLflow's job runner (GenAI scorers: a dozen huey processes): /health answers ~40% sooner here.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    process = subprocess.Popen(command, cwd=store, env=env, stdout=open(store / "server.out", "w"),
                               stderr=subprocess.STDOUT, start_new_session=True)
    yield f"http://127.0.0.1:{port}", process
    os.killpg(process.pid, signal.SIGKILL)  # a test's store: nothing to shut down cleanly (SIGTERM takes ~15 s)
    process.wait(timeout=30)


def answers(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture
def mlflow_uri(server) -> str:
    uri, process = server
    wait_until(lambda: answers(uri) or process.poll() is not None, 180, "the MLflow server's /health")
    assert process.poll() is None, "the MLflow server exited"
    return uri


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {**WANDB_ENV, "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
            "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"), "WANDB_DATA_DIR": str(tmp_path / "wandb-data")}


def client(uri: str):  # noqa: ANN201 - mlflow's MlflowClient
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def runs_of(uri: str, run_dir: Path) -> list:
    """Every MLflow run of the template's experiment that names `run_dir`."""
    experiment = client(uri).get_experiment_by_name("ddp-hydra-template")
    if experiment is None:
        return []
    return client(uri).search_runs([experiment.experiment_id], f"tags.run_dir = '{run_dir}'")


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client(uri).get_metric_history(run_id, key))


def csv_rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "scalars.csv").open() as file:
        return list(csv.DictReader(file))


def csv_steps(run_dir: Path) -> list[int]:
    return [int(row["step"]) for row in csv_rows(run_dir) if row["step"]]


def checkpoint_ids(run_dir: Path) -> dict[str, str]:
    state = torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    return state["callbacks"]["trackers"]["ids"]


def wandb_folders(run_dir: Path) -> list[str]:
    return sorted(path.name.rsplit("-", 1)[1] for path in (run_dir / "wandb").glob("offline-run-*"))


def assert_each_step_once(uri: str, run, run_dir: Path) -> None:
    """Every metric of the MLflow run at every step exactly once, and the same (step, value)s as the CSV."""
    keys = run.data.metrics
    assert {"train/loss", "val/acc", "final/val/acc"} <= set(keys)
    rows = csv_rows(run_dir)
    for key in keys:
        steps = [step for step, _ in history(uri, run.info.run_id, key)]
        assert len(steps) == len(set(steps)), (key, steps)
        assert history(uri, run.info.run_id, key) == sorted(
            (int(row["step"]), float(row["value"])) for row in rows if row["name"] == key), key
    assert [step for step, _ in history(uri, run.info.run_id, "train/loss")] == STEPS
    assert [step for step, _ in history(uri, run.info.run_id, "val/acc")] == [12, 24]
    assert len(csv_steps(run_dir)) == len({(row["name"], row["step"]) for row in rows if row["step"]})


def test_a_logger_whose_package_is_missing_is_one_line_and_leaves_nothing(tmp_path: Path, server):
    hidden = tmp_path / "hide"
    (hidden / "mlflow").mkdir(parents=True)
    (hidden / "mlflow" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'mlflow'\")\n")
    result = train(["logger=mlflow", "trainer.epochs=1"], tmp_path, env={"PYTHONPATH": str(hidden)})
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "error: logger=mlflow needs the mlflow package, which is not installed (No module named 'mlflow'): "
        "pip install mlflow-skinny==3.17.2 (a client of an `mlflow server`; the full mlflow==3.17.2 for a local "
        "store)"]
    assert not (tmp_path / "outputs").exists()


def test_a_server_that_does_not_answer_is_one_line_before_any_work(tmp_path: Path, server):
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        result = train(["logger=[tensorboard,mlflow]", f"logger.mlflow.tracking_uri={uri}",
                        "logger.mlflow.timeout_s=1", "trainer.epochs=1"], tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: logger.mlflow.tracking_uri={uri} does not answer"), lines
    assert "timed out" in lines[0] and time.monotonic() - started < 60
    assert not (tmp_path / "outputs").exists()


def test_a_killed_rank_restarted_by_torchrun_is_one_run_with_each_step_once(tmp_path: Path, mlflow_uri, env,
                                                                             launched):
    run_dir = tmp_path / "run"
    args = [*ARGS, "logger=[mlflow,wandb,csv]", "logger.wandb.mode=offline",
            f"logger.mlflow.tracking_uri={mlflow_uri}", f"hydra.run.dir={run_dir}"]
    agent = launched.start(torchrun_command(args, 2, "--max-restarts=1"), tmp_path, env=env)
    # Killed in epoch 2, past its first checkpoint (12): the restart redoes the steps logged after the last one.
    wait_until(lambda: (run_dir / "scalars.csv").exists() and max(csv_steps(run_dir), default=0) >= 14, 180,
               "step 14 in scalars.csv")
    victims = with_env(descendants(agent.pid), "RANK", "1")
    assert victims
    for victim in victims:
        os.kill(victim, signal.SIGKILL)
    assert agent.wait(timeout=300) == 0, (tmp_path / "launcher.err").read_text()[-3000:]
    assert "resumed from" in (run_dir / "train.log").read_text()

    [run] = runs_of(mlflow_uri, run_dir)  # one run: neither the restart nor rank 1 opened another
    assert run.info.status == "FINISHED" and run.data.tags["stop_reason"] == "completed"
    assert_each_step_once(mlflow_uri, run, run_dir)
    config = json.loads(json.dumps(torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["config"]))
    assert run.data.params == {"trainer.epochs": "2", "trainer.limit_train_batches": "12",
                               "trainer.limit_val_batches": "2", "trainer.log_every_steps": "1",
                               "trainer.checkpoint_every_steps": "4", "optimizer": "sgd", "scheduler": "constant",
                               "task": "classification", "model": "cnn", "dataset": "digits",
                               "optimizer.lr": str(config["optimizer"]["lr"]), "seed": str(config["seed"]),
                               "global_batch_size": "64"}
    ids = json.loads((run_dir / "trackers.json").read_text())["ids"]
    assert ids == checkpoint_ids(run_dir) == {"mlflow": run.info.run_id, "wandb": ids["wandb"]}
    # W&B: one offline folder per attempt, all of the one id; rank 1 wrote none (nor anything elsewhere).
    assert wandb_folders(run_dir) == [ids["wandb"]] * 2
    assert not (tmp_path / "wandb").exists()


def test_a_sigterm_stop_then_resume_auto_continue_the_checkpoints_runs(tmp_path: Path, mlflow_uri, env):
    run_dir = tmp_path / "run"
    args = [*ARGS, "logger=[tensorboard,mlflow,wandb,csv]", "logger.wandb.mode=offline",
            f"logger.mlflow.tracking_uri={mlflow_uri}", f"hydra.run.dir={run_dir}"]
    process = subprocess.Popen([sys.executable, TRAIN, *args], cwd=tmp_path, env={**os.environ, **env},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: (run_dir / "metrics.json").exists(), 180, "epoch 1's metrics.json")
    process.send_signal(signal.SIGTERM)  # in epoch 2
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0 and "stopped at step" in out, err[-2000:]
    [stopped] = runs_of(mlflow_uri, run_dir)
    assert stopped.info.status == "KILLED" and stopped.data.tags["stop_reason"] == "preempted"
    ids = checkpoint_ids(run_dir)
    (run_dir / "trackers.json").unlink()  # the ids can only come from the checkpoint now

    check(train([*args, "resume=auto"], tmp_path, env=env))
    [run] = runs_of(mlflow_uri, run_dir)
    assert run.info.run_id == ids["mlflow"] and run.info.status == "FINISHED"
    assert_each_step_once(mlflow_uri, run, run_dir)
    assert wandb_folders(run_dir) == [ids["wandb"]] * 2
    assert json.loads((run_dir / "trackers.json").read_text())["ids"] == ids == checkpoint_ids(run_dir)
    assert (run_dir / "tb").is_dir()


def test_each_job_of_a_multirun_is_its_own_run_grouped_by_its_sweep(tmp_path: Path, mlflow_uri):
    sweep = tmp_path / "sweep"
    check(train(["-m", "seed=0,1", "trainer.epochs=1", "trainer.limit_train_batches=3", "trainer.limit_val_batches=1",
                 "trainer.log_every_steps=3", "logger=mlflow", f"logger.mlflow.tracking_uri={mlflow_uri}",
                 f"hydra.sweep.dir={sweep}"], tmp_path))
    runs = [runs_of(mlflow_uri, sweep / job) for job in ("0", "1")]
    assert [len(found) for found in runs] == [1, 1]
    (first,), (second,) = runs
    assert first.info.run_id != second.info.run_id
    assert {run.info.status for run in (first, second)} == {"FINISHED"}
    assert [(run.data.tags["sweep"], run.data.tags["sweep_job"], run.data.params["seed"]) for run in (first, second)
            ] == [(str(sweep), "0", "0"), (str(sweep), "1", "1")]
    assert Counter(m.step for m in client(mlflow_uri).get_metric_history(first.info.run_id, "train/loss")) == {3: 1}
