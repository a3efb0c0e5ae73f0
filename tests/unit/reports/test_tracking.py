"""The trackers' run: ids kept in the run dir and the checkpoint, each (key, step) sent once across restarts,
the CSV file repaired after a kill, and how the run ends (FINISHED, KILLED, FAILED) as the loop ended."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from src.common.errors import UsageError
from src.loop.callback import Outcome
from src.reports.reporting import Reporter
from src.reports.trackers import RunIdentity, Tracker
from src.reports.trackers.csv_file import CSVTracker
from src.reports.tracking import IDS_FILE, Trackers, identity_of

CONFIG = {"optimizer": {"lr": 0.1}, "trainer": {"epochs": 2}, "seed": 0}
PARAMS = {"optimizer.lr": 0.1, "trainer.epochs": 2, "seed": 0, "global_batch_size": 64}


class Recording(Tracker):
    """A tracker that keeps what it was sent; `holds`: what its server holds already (None: it cannot tell)."""

    def __init__(self, holds: dict[str, int] | None = None, new_id: str = "run-1") -> None:
        self.holds, self.new_id = holds, new_id
        self.opened: list[tuple[str | None, dict]] = []
        self.logged: list[tuple[dict, int]] = []
        self.closed: list[tuple[str, str | None]] = []

    def open(self, run_id, identity, params):
        self.opened.append((run_id, dict(params)))
        return run_id or self.new_id

    def sent_steps(self):
        return None if self.holds is None else dict(self.holds)

    def log(self, scalars, step):
        self.logged.append((dict(scalars), step))

    def close(self, status, stop_reason):
        self.closed.append((status, stop_reason))


def fake_run(ended=None) -> SimpleNamespace:
    parts = SimpleNamespace(saved_config=CONFIG, data=SimpleNamespace(train_sampler=SimpleNamespace(
        global_batch_size=64)))
    return SimpleNamespace(parts=parts, state=SimpleNamespace(ended=ended))


def opened(tmp_path: Path, tracker: Tracker, checkpoint: dict | None = None) -> Trackers:
    """As the loop drives it: the run's start, a resumed run's checkpoint state, then the first scalars, which
    open the trackers' runs."""
    trackers = Trackers({"t": tracker}, RunIdentity(str(tmp_path), tmp_path))
    trackers.on_run_start(fake_run())
    if checkpoint is not None:
        trackers.load_state_dict(checkpoint)
    trackers.log({}, 0)
    return trackers


def test_a_new_run_gets_the_hyperparameters_and_its_id_is_kept_in_the_run_dir_and_the_checkpoint(tmp_path):
    tracker = Recording()
    trackers = opened(tmp_path, tracker)
    assert tracker.opened == [(None, PARAMS)]
    assert json.loads((tmp_path / IDS_FILE).read_text())["ids"] == {"t": "run-1"}
    assert trackers.state_dict() == {"ids": {"t": "run-1"}}


def test_a_restart_continues_the_run_dirs_id_and_a_resume_the_checkpoints(tmp_path):
    (tmp_path / IDS_FILE).write_text(json.dumps({"ids": {"t": "from-dir"}}))
    restarted = Recording()
    opened(tmp_path, restarted)
    assert restarted.opened[0][0] == "from-dir"
    resumed = Recording()  # resume=PATH: the checkpoint's id wins over the run dir's
    opened(tmp_path, resumed, checkpoint={"ids": {"t": "from-checkpoint"}})
    assert resumed.opened[0][0] == "from-checkpoint"


def test_steps_the_tracker_holds_are_not_sent_again_per_key(tmp_path):
    tracker = Recording(holds={"train/loss": 10, "val/acc": 5})
    trackers = opened(tmp_path, tracker, checkpoint={"ids": {"t": "run-1"}})
    trackers.log({"train/loss": 1.0}, 5)  # redone after the restart: held
    trackers.log({"train/loss": 1.0}, 10)
    trackers.log({"val/acc": 0.5, "train/loss": 0.9}, 10)  # val/acc at 10 is new, train/loss is not
    trackers.log({"train/loss": 0.8}, 15)
    trackers.log({"train/loss": 0.8}, 15)  # never twice within one attempt either
    assert tracker.logged == [({"val/acc": 0.5}, 10), ({"train/loss": 0.8}, 15)]


def test_a_tracker_that_cannot_tell_what_it_holds_is_told_by_the_ledger(tmp_path):
    first = Recording(holds=None)
    trackers = opened(tmp_path, first)
    trackers.log({"train/loss": 1.0}, 5)
    trackers.log({"train/loss": 0.9}, 10)  # then killed: the checkpoint was at step 5
    again = Recording(holds=None)
    trackers = opened(tmp_path, again, checkpoint={"ids": {"t": "run-1"}})
    trackers.log({"train/loss": 0.9}, 10)
    trackers.log({"train/loss": 0.8}, 15)
    assert again.logged == [({"train/loss": 0.8}, 15)]
    other = Recording(holds=None, new_id="run-2")  # a new run of another id learns nothing from the ledger
    other_trackers = Trackers({"t": other}, RunIdentity("x", tmp_path / "other"))
    (tmp_path / "other").mkdir()
    other_trackers.on_run_start(fake_run())
    other_trackers.log({"train/loss": 0.9}, 10)
    assert other.logged == [({"train/loss": 0.9}, 10)]


@pytest.mark.parametrize("outcome, ended, status", [
    (Outcome.COMPLETED, None, ("FINISHED", "completed")),
    (Outcome.ENDED, SimpleNamespace(reason="pruned"), ("FINISHED", "pruned")),
    (Outcome.PREEMPTED, None, ("KILLED", "preempted")),
    (Outcome.MAX_STEPS, None, ("KILLED", "max_steps")),
])
def test_the_run_ends_as_the_loop_ended(tmp_path, outcome, ended, status):
    tracker = Recording()
    trackers = opened(tmp_path, tracker)
    trackers.on_run_end(fake_run(ended), outcome)
    trackers.close()
    trackers.close()  # once
    assert tracker.closed == [status]


def test_a_failure_ends_the_run_failed_at_once(tmp_path):
    tracker = Recording()
    trackers = opened(tmp_path, tracker)
    trackers.on_exception(fake_run(), RuntimeError("boom"))
    trackers.close()
    assert tracker.closed == [("FAILED", "RuntimeError")]


def test_the_reporter_sends_scalars_and_final_metrics_from_the_main_process_only(tmp_path):
    tracker = Recording()
    trackers = opened(tmp_path, tracker)
    Reporter(tmp_path, is_main_process=False, tensorboard=False, trackers=trackers).scalars({"a": 1.0}, 1)
    reporter = Reporter(tmp_path, is_main_process=True, tensorboard=False, trackers=trackers)
    reporter.scalars({"train/loss": 1.0}, 4)
    reporter.hparams(PARAMS, {"val/acc": 0.9})
    reporter.close()
    assert tracker.logged == [({"train/loss": 1.0}, 4), ({"final/val/acc": 0.9}, 4)]
    assert tracker.closed == [("FAILED", None)]  # closed before the loop said how it ended: not FINISHED
    assert not (tmp_path / "tb").exists()


def test_other_ranks_and_tensorboard_alone_open_nothing(tmp_path):
    trackers = Trackers({}, RunIdentity("x", tmp_path))
    trackers.on_run_start(fake_run())
    assert not trackers.enabled and trackers.state_dict() == {}
    assert not (tmp_path / IDS_FILE).exists()


def test_a_sweeps_jobs_are_grouped_by_the_sweep_dir(tmp_path):
    job = identity_of(tmp_path / "sweep" / "3", in_sweep=True)
    assert (job.group, job.job) == (str(tmp_path / "sweep"), "3")
    assert identity_of(tmp_path / "run", in_sweep=False).group is None


def csv_rows(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_csv_holds_each_step_once_after_a_restart_and_drops_a_row_cut_short(tmp_path):
    identity = RunIdentity(str(tmp_path), tmp_path)
    first = CSVTracker()
    first.open(None, identity, {"seed": 0})
    first.log({"train/loss": 1.5, "lr": 0.1}, 5)
    first.log({"train/loss": 1.25}, 10)
    first.close("KILLED", None)
    with (tmp_path / "scalars.csv").open("a") as file:
        file.write("15,train/lo")  # a kill mid-row
    again = CSVTracker()
    again.open(None, identity, {"seed": 0})
    assert again.sent_steps() == {"param/seed": -1, "train/loss": 10, "lr": 5}
    trackers = Trackers({"csv": again}, identity)
    trackers.sent, trackers._open = {"csv": again.sent_steps()}, True
    trackers.log({"train/loss": 1.25}, 10)  # redone
    trackers.log({"train/loss": 1.0, "lr": 0.05}, 15)
    again.close("FINISHED", None)
    assert csv_rows(tmp_path / "scalars.csv") == ["step,name,value", ",param/seed,0", "5,train/loss,1.5", "5,lr,0.1",
                                                  "10,train/loss,1.25", "15,train/loss,1.0", "15,lr,0.05"]


def test_a_tracker_that_cannot_end_its_run_leaves_the_runs_own_error_to_be_seen(tmp_path, caplog):
    class Gone(Recording):
        def close(self, status, stop_reason):
            raise ConnectionError("server gone")

    trackers = opened(tmp_path, Gone())
    trackers.on_exception(fake_run(), RuntimeError("the run's own error"))  # does not raise in its place
    assert "could not end its run as FAILED: server gone" in caplog.text


def test_wandb_that_cannot_start_its_run_is_one_line_and_leaves_no_files(tmp_path, monkeypatch):
    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    for key in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(key, str(tmp_path / key))
    monkeypatch.setenv("WANDB_SILENT", "true")
    from src.reports.trackers.wandb_run import WandbTracker

    (tmp_path / "run").mkdir()
    with pytest.raises(UsageError, match=r"^logger.wandb: W&B could not start the run \(No API key configured"):
        WandbTracker(mode="online", timeout_s=5).open(None, RunIdentity("run", tmp_path / "run"), {})
    assert not (tmp_path / "run" / "wandb").exists()
    with pytest.raises(UsageError, match=r"^logger.wandb.mode=offlin is not one of online \| offline \| disabled$"):
        WandbTracker(mode="offlin")
