"""The Reporter's progress bars (src/reports/reporting.py): drawn on the main process's terminal only, and
counting the steps of an epoch (a resumed one included)."""

from __future__ import annotations

import io
import logging
import re
import sys
from pathlib import Path

import pytest
import torch
from one_model import one_model_parts
from torch import nn
from torch.utils.data import TensorDataset

from src.checkpoint.file_store import FileStore
from src.components.tasks import Classification
from src.config.schema import TrainerConfig
from src.data.loaders import Data, GlobalBatchSampler, TensorBatchLoader
from src.data.splits import DataSplits
from src.loop.callback import Run
from src.loop.trainer import Trainer, TrainState
from src.parallel.distributed import DistEnv, Runtime
from src.reports import reporting
from src.reports.reporting import Reporter, setup_logging


class FakeTerminal(io.StringIO):
    """What tqdm writes, from a stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> FakeTerminal:
    """A terminal to put in place of stdout inside the test (pytest's capture resets sys.stdout after
    fixtures), on which tqdm draws every update (it skips those within 0.1 s of the last drawing)."""
    class EveryUpdate(reporting.tqdm):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, mininterval=0, miniters=1, **kwargs)

    monkeypatch.setattr(reporting, "tqdm", EveryUpdate)
    return FakeTerminal()


def bar_states(output: str, desc: str) -> list[str]:
    """The `done/total` counts of each drawing of the bar named `desc` (tqdm redraws after a \\r)."""
    drawings = [part for part in output.split("\r") if part.startswith(f"{desc}:")]
    return [re.search(r"\| (\d+/\d+) \[", drawing).group(1) for drawing in drawings]


@pytest.mark.parametrize(
    "enabled,is_main_process,stream,expected",
    [
        (True, True, FakeTerminal(), True),
        (True, True, io.StringIO(), False),  # a file or a pipe: no carriage-return noise in logs
        (True, False, FakeTerminal(), False),  # other ranks never draw
        (False, True, FakeTerminal(), False),  # trainer.progress=false
    ],
)
def test_bars_only_for_the_main_process_at_a_terminal(monkeypatch, tmp_path: Path, enabled, is_main_process, stream,
                                                     expected):
    monkeypatch.setattr(sys, "stdout", stream)
    reporter = Reporter(tmp_path, is_main_process, tensorboard=False, progress=enabled)
    assert (not reporter.progress("train", total=2).disable) is expected


@pytest.mark.parametrize("is_main_process,show", [(False, True), (True, False)])
def test_without_a_bar_nothing_is_drawn_or_wrapped(terminal, monkeypatch, tmp_path: Path, is_main_process, show):
    monkeypatch.setattr(sys, "stdout", terminal)
    reporter = Reporter(tmp_path, is_main_process, tensorboard=False, progress=show)
    bar = reporter.progress("train", total=5)
    assert bar.disable  # tqdm's disabled bar: its methods do nothing
    bar.update()
    bar.close()
    batches = [1, 2, 3]
    assert reporter.track(batches, "val") is batches  # the loader itself: no per-batch overhead
    assert terminal.getvalue() == ""


def test_a_bar_counts_its_updates_from_the_steps_already_done(terminal, monkeypatch, tmp_path: Path):
    monkeypatch.setattr(sys, "stdout", terminal)
    reporter = Reporter(tmp_path, is_main_process=True, tensorboard=False, progress=True)
    bar = reporter.progress("epoch 2/3", total=10, done=4)
    for step in range(5, 11):
        bar.update()
        if step == 8:
            reporter.scalars({"train/loss": 0.125}, step)  # a logged loss: shown from the next drawing on
    bar.close()
    assert bar_states(terminal.getvalue(), "epoch 2/3") == [f"{n}/10" for n in range(4, 11)]
    assert "loss=0.1250" in terminal.getvalue()
    assert list(reporter.track(range(3), "val")) == [0, 1, 2]
    assert bar_states(terminal.getvalue(), "val") == ["0/3", "1/3", "2/3", "3/3"]


@pytest.mark.parametrize("step_in_epoch", [0, 2])
def test_a_training_epoch_bar_ends_at_its_steps_also_when_resumed(terminal, monkeypatch, tmp_path: Path, step_in_epoch):
    monkeypatch.setattr(sys, "stdout", terminal)
    torch.manual_seed(0)
    steps, batch = 5, 4
    dataset = TensorDataset(torch.randn(steps * batch, 3), torch.randint(0, 2, (steps * batch,)))
    sampler = GlobalBatchSampler(len(dataset), batch, rank=0, world_size=1)
    splits = DataSplits(train=dataset, val=dataset, info={"num_classes": 2, "num_features": 3})
    cpu = torch.device("cpu")
    data = Data(splits=splits, train_sampler=sampler, train_loader=TensorBatchLoader(dataset, sampler, cpu),
                val_loader=[], num_val_samples=0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reporter = Reporter(tmp_path, is_main_process=True, tensorboard=False, progress=True)
    trainer = Trainer(TrainerConfig(epochs=1),
                      one_model_parts(Runtime(DistEnv(), cpu, backend=None), Classification(), model, model, optimizer,
                                      torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), data,
                                      FileStore(tmp_path / "checkpoints", False), reporter))
    state = TrainState(step=step_in_epoch, step_in_epoch=step_in_epoch)
    trainer.train_one_epoch(0, Run(trainer.config, trainer.parts, state, False, trainer.evaluate))
    drawn = bar_states(terminal.getvalue(), "epoch 1/1")
    assert drawn == [f"{n}/{steps}" for n in range(step_in_epoch, steps + 1)]


def test_a_log_line_goes_above_the_bar_not_onto_its_line(terminal, monkeypatch, tmp_path: Path):
    monkeypatch.setattr(sys, "stdout", terminal)
    try:
        setup_logging(tmp_path, rank=0)
        bar = Reporter(tmp_path, is_main_process=True, tensorboard=False, progress=True).progress("train", total=3)
        bar.update()
        logging.getLogger("train").info("checkpoint at step 1")
        bar.update()
        bar.close()
    finally:
        for handler in list(logging.getLogger().handlers):
            handler.close()
            logging.getLogger().removeHandler(handler)
    before, after = terminal.getvalue().split("checkpoint at step 1\n")
    assert before.rsplit("\r", 1)[1].endswith("[INFO] ") and before.rsplit("\r", 1)[1].startswith("[")  # cleared
    assert bar_states(after, "train") == ["1/3", "2/3"]  # then drawn again below the record
