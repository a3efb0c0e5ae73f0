"""src/common/retries.py (and where a job starts, errors.exit_on_usage_error): a usage error under a restarting
launcher is recorded, and that launcher's restarts exit at once with the same line; nothing else is affected."""

from __future__ import annotations

import os

import pytest

from src.common import errors, retries


def start_job() -> None:
    """What a job does where it starts (train.py's and eval.py's `main`)."""
    with errors.exit_on_usage_error(is_main_process=True):
        pass


@pytest.fixture
def torchrun_worker(monkeypatch, tmp_path):
    """This process as the first attempt of a torchrun worker with 3 restarts; records under tmp_path."""
    monkeypatch.setattr(retries, "RECORDS", tmp_path / "records")
    for key, value in {"TORCHELASTIC_RUN_ID": "test", "TORCHELASTIC_MAX_RESTARTS": "3",
                       "TORCHELASTIC_RESTART_COUNT": "0", "RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    return monkeypatch


def test_a_restart_after_a_usage_error_exits_at_once_with_its_line(torchrun_worker, capsys):
    start_job()  # the first attempt runs
    retries.record_final_failure("dataset.root=/nowhere does not exist")
    torchrun_worker.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(SystemExit) as exit_:
        start_job()
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "error: dataset.root=/nowhere does not exist (not retried: every restart would stop on it)\n")


def test_a_restart_after_another_failure_runs(torchrun_worker):
    torchrun_worker.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # say, a worker was killed
    start_job()


def test_nothing_is_recorded_outside_a_launcher(torchrun_worker):
    torchrun_worker.delenv("TORCHELASTIC_RUN_ID")
    retries.record_final_failure("a mistake")
    assert not retries.RECORDS.exists() and retries.peer_failure() is None


def test_without_restarts_the_record_tells_the_peers_whose_collectives_break(torchrun_worker):
    torchrun_worker.delenv("TORCHELASTIC_MAX_RESTARTS")
    assert retries.peer_failure() is None
    retries.record_final_failure("a mistake")
    assert retries.peer_failure() == "a mistake"
    start_job()  # a first attempt is not a restart: it runs


def test_a_record_is_its_group_s_and_the_launcher_reads_it(torchrun_worker):
    """A process that launches groups in turn (a sweep's jobs, dist.nproc_per_node) is every group's launcher: a
    later group's workers must not take an earlier group's usage error for their peer's."""
    retries.record_final_failure("a mistake")
    torchrun_worker.setenv("TORCHELASTIC_RUN_ID", "the next job")
    assert retries.peer_failure() is None
    torchrun_worker.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    start_job()  # a restart of the next job runs
    launcher = os.getppid()  # the worker's parent: the process that launched both groups reads each one's record
    assert retries.peer_failure(launcher, "test") == "a mistake" and retries.peer_failure(launcher, "other") is None


def test_records_of_launchers_that_are_gone_are_removed(torchrun_worker):
    retries.RECORDS.mkdir()
    (retries.RECORDS / "999999999-1").write_text("old")  # no such process (a record named as before run ids)
    (retries.RECORDS / "999999999-1.0123456789ab").write_text("old")
    retries.record_final_failure("a mistake")
    assert [path.read_text() for path in retries.RECORDS.iterdir()] == ["a mistake"]
