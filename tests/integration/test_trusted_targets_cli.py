"""Checkpoints are data, never code, through the real CLI: a `_target_` in a checkpoint's saved config
that the user did not trust is refused before anything is built, by `eval.py` and `train.py resume=`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, check, copy_run, run, train

EVAL = str(REPO / "eval.py")
OWN_MODEL = """
from torch import nn


class MyNet(nn.Module):
    def __init__(self, in_features, num_outputs, width=32):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, width), nn.ReLU(), nn.Linear(width, num_outputs))

    def forward(self, x):
        return self.net(x)
"""


# -- the real command line ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(one_epoch_run: Path, tmp_path_factory) -> Path:
    """A workdir holding a finished 1-epoch digits run in `run/`."""
    workdir = tmp_path_factory.mktemp("trusted")
    copy_run(one_epoch_run, workdir / "run")
    return workdir


def crafted_checkpoint(workdir: Path, name: str, sentinel: Path) -> Path:
    """A real checkpoint whose saved dataset config calls `builtins.open(sentinel, "w")`: building
    that dataset would create the sentinel file (as `torch.load` of a pickle would run it)."""
    payload = torch.load(workdir / "run" / "checkpoints" / "last.pt", weights_only=True)
    payload["config"]["dataset"] = {"_target_": "builtins.open", "file": str(sentinel), "mode": "w",
                                    "batch_size": 64, "num_workers": 0}
    torch.save(payload, workdir / name)
    return workdir / name


def assert_refused(result, sentinel: Path) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, result.stderr[-3000:]
    assert "dataset._target_=builtins.open" in error_lines[0]
    assert "trusted_targets=[builtins.open]" in error_lines[0]
    assert "Traceback" not in result.stderr
    assert not sentinel.exists()


@pytest.mark.slow
def test_eval_refuses_a_checkpoint_naming_an_untrusted_target(trained: Path):
    sentinel = trained / "eval_sentinel"
    evil = crafted_checkpoint(trained, "evil_eval.pt", sentinel)
    assert_refused(run([sys.executable, EVAL, f"checkpoint={evil}"], trained), sentinel)


@pytest.mark.slow
def test_eval_refuses_a_target_hidden_in_an_interpolation(trained: Path):
    sentinel = trained / "interpolated_sentinel"
    payload = torch.load(trained / "run" / "checkpoints" / "last.pt", weights_only=True)
    # logging.basicConfig(filename=..., force=True) creates the file before refusing the model's shape arguments.
    payload["config"]["model"] = f"${{oc.create:{{_target_: logging.basicConfig, filename: {sentinel}, force: true}}}}"
    torch.save(payload, trained / "interpolated.pt")
    result = run([sys.executable, EVAL, f"checkpoint={trained / 'interpolated.pt'}"], trained)
    assert not sentinel.exists()
    assert result.returncode == 2 and "holds the interpolation model=" in result.stderr, result.stderr[-3000:]


@pytest.mark.slow
def test_eval_builds_a_target_the_user_allowed(trained: Path):
    """The same file with the target allowed: it is called (the test above could fail)."""
    sentinel = trained / "allowed_sentinel"
    evil = crafted_checkpoint(trained, "allowed.pt", sentinel)
    run([sys.executable, EVAL, f"checkpoint={evil}", "trusted_targets=[builtins.open]"], trained)
    assert sentinel.exists()


@pytest.mark.slow
def test_resume_refuses_a_checkpoint_naming_an_untrusted_target(trained: Path):
    sentinel = trained / "resume_sentinel"
    evil = crafted_checkpoint(trained, "evil_resume.pt", sentinel)
    assert_refused(train(["trainer.epochs=2", f"resume={evil}", "hydra.run.dir=resumed"], trained), sentinel)
    assert not (trained / "resumed" / "checkpoints").exists()  # nothing trained


@pytest.mark.slow
def test_a_model_of_the_users_own_module_evaluates_once_trusted(tmp_path: Path):
    """A model class outside conf/ (the README's "Fork it"): a checkpoint of it is refused by a plain
    `eval.py`, and accepted through `trusted_targets` or the search path that named it."""
    (tmp_path / "mine.py").write_text(OWN_MODEL)
    (tmp_path / "myconf" / "model").mkdir(parents=True)
    (tmp_path / "myconf" / "model" / "mynet.yaml").write_text(
        "_target_: mine.MyNet\nin_features: ${data:num_features}\nnum_outputs: ${data:num_outputs}\n")
    searchpath = f"hydra.searchpath=[file://{tmp_path / 'myconf'}]"
    env = {"PYTHONPATH": str(tmp_path)}
    check(train(["model=mynet", searchpath, "trainer.epochs=1", "hydra.run.dir=run"], tmp_path, env=env))
    checkpoint = f"checkpoint={tmp_path / 'run' / 'checkpoints' / 'last.pt'}"

    refused = run([sys.executable, EVAL, checkpoint], tmp_path, env=env)
    assert refused.returncode == 2 and "model._target_=mine.MyNet" in refused.stderr
    for allowed in ("trusted_targets=[mine.MyNet]", searchpath):
        result = check(run([sys.executable, EVAL, checkpoint, allowed, "hydra.run.dir=eval"], tmp_path, env=env))
        assert "test/acc=" in result.stdout
