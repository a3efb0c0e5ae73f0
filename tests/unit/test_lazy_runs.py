"""The shared-launch helper of the CLI tests (tests/fixtures/lazy_runs.py): a job of its multirun composes the
config its overrides compose on the command line, also with a group that only a fork's conf/ has; a launch that
failed fails each test that asks for one of its runs with its error, and is not launched again."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO
from hydra import compose, initialize_config_dir
from lazy_runs import LazyRuns, job_config
from omegaconf import OmegaConf

from src.config import schema  # noqa: F401  (registers train_schema, which conf/config.yaml names)

OVERRIDES = ["model=mlp", "optimizer=sgd", "optimizer.lr=0.05", "trainer.epochs=3",
             "dataset=synthetic", "dataset.image_size=[8,8]", "model=cnn"]  # the last choice of a group wins


def composed(conf: Path, overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=False)


def as_a_job(conf: Path, overrides: list[str], tmp_path: Path) -> dict:
    """The config of `overrides` written as a `run` option by job_config, composed as LazyRuns launches it."""
    (tmp_path / "run").mkdir(parents=True)
    (tmp_path / "run" / "job.yaml").write_text(job_config(overrides, "job", (conf, tmp_path)))
    return composed(conf, ["+run=job", f"hydra.searchpath=[file://{tmp_path}]"])


def test_a_job_composes_what_its_overrides_compose(tmp_path: Path):
    assert as_a_job(REPO / "conf", OVERRIDES, tmp_path) == composed(REPO / "conf", OVERRIDES)


def test_a_group_only_a_forks_conf_has_is_chosen_as_a_group(tmp_path: Path):
    fork = tmp_path / "fork"
    (fork / "teacher").mkdir(parents=True)
    (fork / "config.yaml").write_text("defaults:\n  - teacher: small\n  - _self_\nlr: 0.1\n")
    for name, width in (("small", 4), ("large", 64)):
        (fork / "teacher" / f"{name}.yaml").write_text(f"width: {width}\n")
    overrides = ["teacher=large", "lr=0.5"]
    job = as_a_job(fork, overrides, tmp_path / "runs")
    assert job == composed(fork, overrides) == {"teacher": {"width": 64}, "lr": 0.5}


def test_a_failed_launch_fails_each_run_of_it_with_its_error_and_is_not_launched_again(tmp_path: Path):
    script = tmp_path / "train.py"  # a train.py that records each launch and fails: a real interpreter, no torch
    script.write_text("import sys\nwith open(sys.argv[0] + '.launches', 'a') as f:\n    f.write('launch\\n')\n"
                      "sys.exit('boom: the run failed')\n")
    runs = LazyRuns(tmp_path / "root", {"a": (1, ["optimizer.lr=0.1"]), "b": (1, ["optimizer.lr=0.2"]),
                                        "c": (1, ["optimizer.lr=0.3"])}, alone=("c",), script=str(script))
    (tmp_path / "root").mkdir()
    with pytest.raises(AssertionError, match="boom: the run failed") as first:
        runs("a")
    with pytest.raises(AssertionError) as second:  # the other job of the same multirun
        runs("b")
    assert str(second.value).startswith("b: its launch failed (for an earlier test)\n")
    assert str(first.value) in str(second.value)
    assert (tmp_path / "train.py.launches").read_text() == "launch\n"
    with pytest.raises(AssertionError, match="boom"):  # a run launched alone is a launch of its own
        runs("c")
    with pytest.raises(AssertionError, match="c: its launch failed"):
        runs("c")
    assert (tmp_path / "train.py.launches").read_text() == "launch\nlaunch\n"
