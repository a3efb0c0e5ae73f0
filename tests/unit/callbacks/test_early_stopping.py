"""The early-stopping rule (src/callbacks/early_stopping.py), and the loop stopping when a callback says so
(src/loop/trainer.py): after the epoch's checkpoint, which holds the decision, so a resumed run trains no more;
the Optuna pruning callback asked after every epoch but the last. That every rank stops on rank 0's decision
is run on 2 ranks by tests/integration/test_finetune_cli.py and test_sweeps_cli.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from one_model import one_model_parts
from torch import nn
from torch.utils.data import TensorDataset

from src import checkpoint
from src.callbacks.early_stopping import EarlyStopping, early_stop_due, epochs_without_improvement
from src.callbacks.optuna_pruning import OptunaPruning
from src.checkpoint.file_store import FileStore
from src.components.tasks import Classification
from src.config.schema import TrainerConfig
from src.data.loaders import Data, GlobalBatchSampler, TensorBatchLoader
from src.data.splits import DataSplits
from src.loop.callback import Callback, Callbacks, EndRun, Outcome
from src.loop.trainer import Trainer, TrainState
from src.parallel.distributed import DistEnv, Runtime
from src.reports.reporting import Reporter

GLOBAL_BATCH = 8
STEPS = 3


@pytest.mark.parametrize("values, mode, min_delta, since", [
    ([], "max", 0.0, 0),
    ([0.5], "max", 0.0, 0),
    ([0.5, 0.6, 0.7], "max", 0.0, 0),
    ([0.5, 0.5, 0.5], "max", 0.0, 2),  # equal is no improvement
    ([0.5, 0.4, 0.6, 0.55], "max", 0.0, 1),
    ([0.5, 0.55, 0.59, 0.58], "max", 0.1, 3),  # small gains: none beyond min_delta over the best (0.5)
    ([0.5, 0.55, 0.61, 0.65], "max", 0.1, 1),  # 0.61 > 0.5 + 0.1: the new best
    ([1.0, 0.9, 1.1], "min", 0.0, 1),
    ([1.0, 1.1, 1.2], "min", 0.0, 2),
    ([1.0, 0.95, 0.92], "min", 0.1, 2),
    ([1.0, float("nan"), 1.0], "min", 0.0, 2),  # a NaN never improves
])
def test_epochs_without_improvement(values, mode, min_delta, since):
    assert epochs_without_improvement(values, mode, min_delta) == since


def test_early_stop_is_due_after_patience_epochs_without_improvement():
    assert not early_stop_due([0.5, 0.5, 0.5], "max", None, 0.0)  # null patience: never
    assert not early_stop_due([0.5, 0.5], "max", 2, 0.0)
    assert early_stop_due([0.5, 0.5, 0.5], "max", 2, 0.0)
    assert early_stop_due([0.5, 0.4], "max", 1, 0.0)
    assert Outcome.ENDED.is_final and Outcome.COMPLETED.is_final
    assert not Outcome.MAX_STEPS.is_final and not Outcome.PREEMPTED.is_final


def tiny_data() -> Data:
    torch.manual_seed(0)
    dataset = TensorDataset(torch.randn(GLOBAL_BATCH * STEPS, 4), torch.randint(0, 3, (GLOBAL_BATCH * STEPS,)))
    sampler = GlobalBatchSampler(len(dataset), GLOBAL_BATCH, rank=0, world_size=1)
    splits = DataSplits(train=dataset, val=dataset, info={"num_classes": 3, "num_features": 4})
    cpu = torch.device("cpu")
    return Data(splits=splits, train_sampler=sampler, train_loader=TensorBatchLoader(dataset, sampler, cpu),
                val_loader=TensorBatchLoader(dataset, [list(range(len(dataset)))], cpu), num_val_samples=len(dataset))


def plateau_trainer(tmp_path: Path, patience: int | None, epochs: int = 6, judge: Callback | None = None) -> Trainer:
    """A linear model with lr=0: every epoch's val metrics equal the first's, a plateau from epoch 1."""
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    data = tiny_data()
    config = TrainerConfig(epochs=epochs, monitor="val/loss", monitor_mode="min")
    callbacks = Callbacks({"early_stopping": EarlyStopping(patience=patience, min_delta=0.0),
                           **({} if judge is None else {"judge": judge})})
    runtime = Runtime(DistEnv(), torch.device("cpu"), backend=None)
    return Trainer(config, one_model_parts(runtime, Classification(), model, model, optimizer,
                                           torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), data,
                                           FileStore(tmp_path / "checkpoints", True),
                                           Reporter(tmp_path, True, tensorboard=False), callbacks))


def resume(trainer: Trainer, path: Path) -> TrainState:
    """A TrainState continued from the checkpoint `path`, every part restored into `trainer`'s (as train.py does)."""
    state = TrainState()
    checkpoint.read(path).restore(trainer.stateful(state))
    return state


EARLY_STOPPED = ("early_stopped", 3, "early stopping had ended this run")


def ended(state: TrainState) -> tuple[str, int, str] | None:
    """Why, after which epoch and by whom a callback ended the run (None: it did not)."""
    return None if state.ended is None else (state.ended.reason, state.ended.epoch, state.ended.ended_by)


def test_the_loop_stops_after_patience_epochs_and_a_resumed_run_trains_no_more(tmp_path: Path, caplog):
    trainer = plateau_trainer(tmp_path, patience=2)
    state = TrainState()
    assert trainer.fit(state) is Outcome.ENDED
    assert (state.epoch, ended(state), state.step) == (3, EARLY_STOPPED, 3 * STEPS)  # patience + 1 epochs
    summary = json.loads((tmp_path / "metrics.json").read_text())
    assert (summary["stop_reason"], summary["stopped_at_epoch"], summary["epoch"]) == ("early_stopped", 3, 3)
    assert summary["frozen_parameters"] == 0
    saved = checkpoint.read(tmp_path / "checkpoints" / "last.pt")  # the stopping epoch's checkpoint
    assert (saved.loop["epoch"], saved.loop["ended"]) == (3, vars(state.ended))

    resumed = plateau_trainer(tmp_path, patience=2)
    again = resume(resumed, tmp_path / "checkpoints" / "last.pt")
    written = (tmp_path / "metrics.json").read_bytes()
    with caplog.at_level("INFO"):
        assert resumed.fit(again) is Outcome.ENDED
    assert (again.epoch, again.step, len(again.history)) == (3, 3 * STEPS, 3)  # nothing trained
    assert (tmp_path / "metrics.json").read_bytes() == written
    assert "early stopping had ended this run after epoch 3: nothing more to train" in caplog.text


def test_without_patience_or_on_the_last_epoch_the_run_completes(tmp_path: Path):
    state = TrainState()
    assert plateau_trainer(tmp_path / "off", patience=None, epochs=4).fit(state) is Outcome.COMPLETED
    assert state.epoch == 4 and state.ended is None
    assert "stop_reason" not in json.loads((tmp_path / "off" / "metrics.json").read_text())
    state = TrainState()  # patience runs out exactly at the last epoch: the run completed all the same
    assert plateau_trainer(tmp_path / "last", patience=2, epochs=3).fit(state) is Outcome.COMPLETED
    assert state.ended is None


class Judge(Callback):
    """A callback that stops the run after `epoch`, as a pruner does; records the history it was shown."""

    def __init__(self, epoch: int) -> None:
        self.epoch, self.shown = epoch, []

    def on_epoch_end(self, run, record):
        self.shown.append([epoch["epoch"] for epoch in run.state.history])
        if record["epoch"] >= self.epoch:
            return EndRun("pruned", f"pruned after epoch {record['epoch']}", ended_by="the judge had ended this run")
        return None


def test_a_run_a_callback_stops_ends_after_that_epoch_with_its_checkpoint_and_trains_no_more(tmp_path: Path):
    judge = Judge(epoch=2)
    state = TrainState()
    assert plateau_trainer(tmp_path, patience=None, judge=judge).fit(state) is Outcome.ENDED
    assert (state.epoch, ended(state), state.step) == (2, ("pruned", 2, "the judge had ended this run"),
                                                        2 * STEPS)
    assert judge.shown == [[1], [1, 2]]  # the whole history, after every epoch
    summary = json.loads((tmp_path / "metrics.json").read_text())
    assert (summary["stop_reason"], summary["stopped_at_epoch"], summary["epoch"]) == ("pruned", 2, 2)
    saved = checkpoint.read(tmp_path / "checkpoints" / "last.pt")
    assert (saved.loop["epoch"], saved.loop["ended"]["epoch"]) == (2, 2)

    resumed = plateau_trainer(tmp_path, patience=None, judge=Judge(epoch=99))
    again = resume(resumed, tmp_path / "checkpoints" / "last.pt")
    assert resumed.fit(again) is Outcome.ENDED and again.epoch == 2


class FakeTrial:
    """An Optuna trial's stand-in: what was reported, and the pruner's answer."""

    def __init__(self, prune: bool) -> None:
        self.number, self.prune, self.reported = 0, prune, {}
        self.study = SimpleNamespace(get_trials=lambda deepcopy: [SimpleNamespace(number=0,
                                                                                  intermediate_values=self.reported)])

    def report(self, value: float, step: int) -> None:
        self.reported[step] = value

    def should_prune(self) -> bool:
        return self.prune


def pruning(monkeypatch, prune: bool) -> OptunaPruning:
    monkeypatch.setenv("DDP_TEMPLATE_OPTUNA_TRIAL", "0")
    callback = OptunaPruning()
    callback.trial = FakeTrial(prune)
    return callback


def test_the_pruner_is_asked_after_every_epoch_but_the_last(monkeypatch, tmp_path: Path):
    trial = pruning(monkeypatch, prune=False)
    state = TrainState()
    monkeypatch.setattr(OptunaPruning, "on_run_start", lambda self, run: None)  # the fake trial stays
    assert plateau_trainer(tmp_path, patience=None, epochs=3, judge=trial).fit(state) is Outcome.COMPLETED
    assert sorted(trial.trial.reported) == [1, 2] and state.ended is None  # epoch 3, the last, not reported
    pruned = pruning(monkeypatch, prune=True)
    state = TrainState()
    assert plateau_trainer(tmp_path / "pruned", patience=None, epochs=3, judge=pruned).fit(state) is Outcome.ENDED
    assert ended(state) == ("pruned", 1, "the sweep's pruner had ended this trial")


def test_pruning_is_off_outside_a_trial(monkeypatch):
    monkeypatch.delenv("DDP_TEMPLATE_OPTUNA_TRIAL", raising=False)
    assert not OptunaPruning().enabled
