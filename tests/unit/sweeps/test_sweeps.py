"""src/sweeps/ without training: the search-space grammar, what a job dir says about its job, and the
sweepers' bookkeeping (the sweeps themselves run in tests/integration/test_sweeps_cli.py)."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from src.common.errors import UsageError
from src.sweeps import jobs, search_space
from src.sweeps.optuna_sweeper import counted_trials, next_job_number


def space_of(*lines: str):
    return search_space.split(OverridesParser.create().parse_overrides(list(lines)))


def test_the_plugins_grammar_maps_to_optuna_distributions():
    space, fixed = space_of("optimizer.lr=tag(log,interval(1e-4,1e-1))", "optimizer=choice(sgd,adamw)",
                            "dataset.batch_size=32,64", "model.width=range(8,40,8)", "trainer.epochs=3")
    assert space == {
        "optimizer.lr": optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True),
        "optimizer": optuna.distributions.CategoricalDistribution(["sgd", "adamw"]),
        "dataset.batch_size": optuna.distributions.CategoricalDistribution([32, 64]),
        "model.width": optuna.distributions.IntDistribution(8, 32, step=8),  # range's stop is excluded
    }
    assert fixed == ["trainer.epochs=3"]


@pytest.mark.parametrize("line,message", [
    ("optimizer.lr=glob(*)", "optimizer.lr names no distribution Optuna can sample"),
    ("optimizer.lr=tag(foo,interval(0.1,1))", "the only tag a search space takes is log"),
    ("optimizer=tag(log,choice(a,b))", "the only tag a search space takes is log"),
    ("optimizer.lr=tag(log,interval(0,1))", "a log interval needs low > 0"),
    ("optimizer=shuffle(choice(a,b))", "optimizer names no distribution"),
])
def test_what_names_no_distribution_is_refused(line, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        space_of(line)


def test_a_trials_overrides_read_back_to_the_sampled_values():
    sampled = {"optimizer.lr": 0.1 / 3, "optimizer": "sgd", "name": "a b,c", "trainer.monitor": None}
    overrides = [f"{key}={search_space.override_value(value)}" for key, value in sampled.items()]
    parsed = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(overrides)}
    assert parsed == sampled


def make_job(job_dir: Path, overrides: list[str], epochs: int = 3, metrics: dict | None = None) -> Path:
    (job_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(overrides), job_dir / ".hydra" / "overrides.yaml")
    OmegaConf.save(OmegaConf.create({"trainer": {"epochs": epochs}}), job_dir / ".hydra" / "config.yaml")
    if metrics is not None:
        (job_dir / "metrics.json").write_text(json.dumps(metrics))
    return job_dir


def test_a_job_dir_says_what_became_of_its_job(tmp_path: Path):
    assert jobs.job_state(tmp_path / "none") is None
    assert jobs.job_state(make_job(tmp_path / "done", [], metrics={"epoch": 3})) == "completed"
    assert jobs.job_state(make_job(tmp_path / "early", [], metrics={"epoch": 2, "stop_reason": "early_stopped"})) \
        == "completed"
    assert jobs.job_state(make_job(tmp_path / "pruned", [], metrics={"epoch": 1, "stop_reason": "pruned"})) == "pruned"
    assert jobs.job_state(make_job(tmp_path / "killed", [], metrics={"epoch": 1})) == "incomplete"
    assert jobs.job_state(make_job(tmp_path / "started", [])) == "incomplete"
    failed = make_job(tmp_path / "failed", [], metrics={"epoch": 3})
    (failed / jobs.FAILED_MARKER).write_text("RuntimeError: boom\n")
    assert jobs.job_state(failed) == "failed"


def test_a_job_run_again_resumes_in_its_dir_and_another_sweeps_job_is_refused(tmp_path: Path):
    job = make_job(tmp_path / "2", ["optimizer.lr=0.1"], metrics={"epoch": 1})
    (job / jobs.FAILED_MARKER).write_text("RuntimeError: boom\n")
    jobs.check_same_job(job, ["optimizer.lr=0.1", "++hydra.job.env_set.X=1"])  # hydra overrides are not saved
    with pytest.raises(UsageError, match=r"holds another sweep.s job \(optimizer.lr=0.1\), not this one"):
        jobs.check_same_job(job, ["optimizer.lr=0.2"])
    assert jobs.rerun_overrides(tmp_path / "new", ["a=1"]) == ["a=1"]
    assert jobs.rerun_overrides(job, ["optimizer.lr=0.1"]) == [
        "optimizer.lr=0.1", "++hydra.job.env_set.DDP_TEMPLATE_SWEEP_JOB_RESUMES=1"]
    assert not (job / jobs.FAILED_MARKER).exists()  # the new attempt's outcome decides


def test_resume_null_means_auto_for_a_sweep_job_run_again():
    from src.parallel.ranks import resume_setting

    assert resume_setting(None, {}) is None
    assert resume_setting(None, {"DDP_TEMPLATE_SWEEP_JOB_RESUMES": "1"}) == "auto"
    assert resume_setting("ckpt.pt", {"DDP_TEMPLATE_SWEEP_JOB_RESUMES": "1"}) == "ckpt.pt"


def test_trials_that_died_do_not_count_and_job_numbers_are_never_reused():
    study = optuna.create_study()
    space = {"x": optuna.distributions.FloatDistribution(0, 1)}
    for job, (state, died) in enumerate([("COMPLETE", False), ("PRUNED", False), ("FAIL", False), ("FAIL", True)]):
        trial = study.ask(space)
        trial.set_user_attr("job", job)
        if died:
            trial.set_user_attr("died", True)
        study.tell(trial, 0.5 if state == "COMPLETE" else None, state=optuna.trial.TrialState[state])
    assert counted_trials(study) == 3
    study.enqueue_trial({"x": 0.3}, user_attrs={"job": 7})
    assert next_job_number(study) == 8
