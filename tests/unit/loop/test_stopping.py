"""src/loop/stopping.py's early-stopping rule, and the loop stopping on it (src/loop/trainer.py): after the
epoch's checkpoint, which holds the decision, so a resumed run trains no more."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from src.components.tasks import Classification
from src.config.schema import EarlyStoppingConfig, TrainerConfig
from src.data.loaders import Data, GlobalBatchSampler, TensorBatchLoader
from src.data.splits import DataSplits
from src.loop import checkpoint
from src.loop.checkpoint import Checkpointer
from src.loop.stopping import StopReason, early_stop_due, epochs_without_improvement
from src.loop.trainer import Trainer, TrainParts, TrainState
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
    assert StopReason.EARLY_STOPPED.is_final and StopReason.COMPLETED.is_final
    assert not StopReason.MAX_STEPS.is_final and not StopReason.PREEMPTED.is_final


def tiny_data() -> Data:
    torch.manual_seed(0)
    dataset = TensorDataset(torch.randn(GLOBAL_BATCH * STEPS, 4), torch.randint(0, 3, (GLOBAL_BATCH * STEPS,)))
    sampler = GlobalBatchSampler(len(dataset), GLOBAL_BATCH, rank=0, world_size=1)
    splits = DataSplits(train=dataset, val=dataset, info={"num_classes": 3, "num_features": 4})
    cpu = torch.device("cpu")
    return Data(splits=splits, train_sampler=sampler, train_loader=TensorBatchLoader(dataset, sampler, cpu),
                val_loader=TensorBatchLoader(dataset, [list(range(len(dataset)))], cpu), num_val_samples=len(dataset))


def plateau_trainer(tmp_path: Path, patience: int | None, epochs: int = 6, epoch_judge=None) -> Trainer:
    """A linear model with lr=0: every epoch's val metrics equal the first's, a plateau from epoch 1."""
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    data = tiny_data()
    config = TrainerConfig(epochs=epochs, monitor="val/loss", monitor_mode="min",
                           early_stopping=EarlyStoppingConfig(patience=patience))
    return Trainer(config, TrainParts(Runtime(DistEnv(), torch.device("cpu"), backend=None), Classification(), model,
                                      model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
                                      data, Checkpointer(tmp_path / "checkpoints", True),
                                      Reporter(tmp_path, True, tensorboard=False), epoch_judge=epoch_judge))


def test_the_loop_stops_after_patience_epochs_and_a_resumed_run_trains_no_more(tmp_path: Path):
    trainer = plateau_trainer(tmp_path, patience=2)
    state = TrainState()
    assert trainer.fit(state) is StopReason.EARLY_STOPPED
    assert (state.epoch, state.early_stopped_at, state.step) == (3, 3, 3 * STEPS)  # patience + 1 epochs
    summary = json.loads((tmp_path / "metrics.json").read_text())
    assert (summary["stop_reason"], summary["stopped_at_epoch"], summary["epoch"]) == ("early_stopped", 3, 3)
    assert summary["frozen_parameters"] == 0
    saved = checkpoint.load(tmp_path / "checkpoints" / "last.pt")  # the stopping epoch's checkpoint
    assert (saved["epoch"], saved["early_stopped_at"]) == (3, 3)

    resumed = plateau_trainer(tmp_path, patience=2)
    again = resumed.load_state_dict(saved)
    written = (tmp_path / "metrics.json").read_bytes()
    assert resumed.fit(again) is StopReason.EARLY_STOPPED
    assert (again.epoch, again.step, len(again.history)) == (3, 3 * STEPS, 3)  # nothing trained
    assert (tmp_path / "metrics.json").read_bytes() == written


def test_without_patience_or_on_the_last_epoch_the_run_completes(tmp_path: Path):
    state = TrainState()
    assert plateau_trainer(tmp_path / "off", patience=None, epochs=4).fit(state) is StopReason.COMPLETED
    assert state.epoch == 4 and state.early_stopped_at is None
    assert "stop_reason" not in json.loads((tmp_path / "off" / "metrics.json").read_text())
    state = TrainState()  # patience runs out exactly at the last epoch: the run completed all the same
    assert plateau_trainer(tmp_path / "last", patience=2, epochs=3).fit(state) is StopReason.COMPLETED
    assert state.early_stopped_at is None


def test_a_checkpoint_without_the_early_stop_key_resumes():
    old = {"epoch": 2, "step": 6, "history": [{"epoch": 1}, {"epoch": 2}]}
    assert TrainState.from_checkpoint(old).early_stopped_at is None


class Judge:
    """An epoch judge (a pruner's stand-in) that stops the run after `epoch`; records what it was shown."""

    def __init__(self, epoch: int) -> None:
        self.epoch, self.shown = epoch, []

    def __call__(self, history: list[dict[str, float]]) -> bool:
        self.shown.append([record["epoch"] for record in history])
        return history[-1]["epoch"] >= self.epoch


def test_a_pruned_run_stops_after_the_judged_epoch_with_its_checkpoint_and_trains_no_more(tmp_path: Path):
    judge = Judge(epoch=2)
    state = TrainState()
    assert plateau_trainer(tmp_path, patience=None, epoch_judge=judge).fit(state) is StopReason.PRUNED
    assert StopReason.PRUNED.is_final
    assert (state.epoch, state.pruned_at, state.step) == (2, 2, 2 * STEPS)
    assert judge.shown == [[1], [1, 2]]  # the whole history, after every epoch
    summary = json.loads((tmp_path / "metrics.json").read_text())
    assert (summary["stop_reason"], summary["stopped_at_epoch"], summary["epoch"]) == ("pruned", 2, 2)
    saved = checkpoint.load(tmp_path / "checkpoints" / "last.pt")
    assert (saved["epoch"], saved["pruned_at"]) == (2, 2)

    resumed = plateau_trainer(tmp_path, patience=None, epoch_judge=Judge(epoch=99))
    again = resumed.load_state_dict(saved)
    assert resumed.fit(again) is StopReason.PRUNED and again.epoch == 2


def test_the_judge_is_not_asked_after_the_last_epoch(tmp_path: Path):
    judge = Judge(epoch=1)
    state = TrainState()
    assert plateau_trainer(tmp_path, patience=None, epochs=1, epoch_judge=judge).fit(state) is StopReason.COMPLETED
    assert judge.shown == [] and state.pruned_at is None
