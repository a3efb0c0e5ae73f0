"""Tests for src/loop/trainer.py: what the loop asks of DDP on each micro-step.

A one-rank gloo group is enough to watch DDP's gradient all-reduce: a communication hook
runs exactly when DDP reduces, so counting its calls shows which micro-steps synchronise.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from one_model import one_model_parts
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

from src.checkpoint.file_store import FileStore
from src.components.tasks import Classification
from src.config.schema import TrainerConfig
from src.data.loaders import Data, GlobalBatchSampler, TensorBatchLoader
from src.data.splits import DataSplits
from src.loop.callback import Outcome, Run
from src.loop.trainer import Trainer, TrainState
from src.parallel.distributed import DistEnv, Runtime
from src.reports.reporting import Reporter

GLOBAL_BATCH = 8
STEPS = 3


@pytest.fixture
def one_rank_group(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def tiny_data(grad_accum: int) -> Data:
    torch.manual_seed(0)
    dataset = TensorDataset(torch.randn(GLOBAL_BATCH * STEPS, 4), torch.randint(0, 3, (GLOBAL_BATCH * STEPS,)))
    sampler = GlobalBatchSampler(len(dataset), GLOBAL_BATCH, rank=0, world_size=1, grad_accum=grad_accum)
    splits = DataSplits(train=dataset, val=dataset, info={"num_classes": 3, "num_features": 4})
    cpu = torch.device("cpu")
    return Data(splits=splits, train_sampler=sampler, train_loader=TensorBatchLoader(dataset, sampler, cpu),
                val_loader=[], num_val_samples=0)


@pytest.mark.parametrize(("grad_accum", "compiled"), [(1, False), (2, False), (4, False), (2, True)])
def test_gradients_are_all_reduced_on_the_last_micro_step_only(one_rank_group, tmp_path: Path, grad_accum: int,
                                                               compiled: bool):
    model = nn.Linear(4, 3)  # one gradient bucket: one all-reduce per synchronised backward
    ddp = DistributedDataParallel(model)
    micro_steps = []  # one entry per forward pass
    reduced_on = []  # the micro-steps (1-based) whose backward all-reduced
    model.register_forward_hook(lambda *_: micro_steps.append(len(micro_steps) + 1))

    def counting_allreduce(state, bucket):
        reduced_on.append(len(micro_steps))
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_allreduce)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    runtime = Runtime(DistEnv(), torch.device("cpu"), backend="gloo")
    # trainer.compile=true wraps the DDP model (train.py); no_sync must still reach the DDP inside.
    # aot_eager: dynamo and autograd tracing as with inductor, without building C++ kernels.
    train_model = torch.compile(ddp, backend="aot_eager") if compiled else ddp
    trainer = Trainer(TrainerConfig(epochs=1, grad_accum=grad_accum),
                      one_model_parts(runtime, Classification(), model, train_model, optimizer,
                                      torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
                                      tiny_data(grad_accum), FileStore(tmp_path / "checkpoints", False),
                                      Reporter(tmp_path, False)))
    assert trainer.step._gradient_syncs["model"].__self__ is ddp  # the DDP inside torch.compile's wrapper
    state = TrainState()
    trainer.train_one_epoch(0, Run(trainer.config, trainer.parts, state, False, trainer.evaluate))
    assert len(micro_steps) == STEPS * grad_accum and state.step == STEPS
    # Without no_sync every micro-step would all-reduce: STEPS * grad_accum calls.
    assert reduced_on == [grad_accum * (step + 1) for step in range(STEPS)]


class WithTop2(Classification):
    """The README's "add a metric": one more named sum in the all-reduced vector, one more value."""

    metric_names = (*Classification.metric_names, "top2")

    def sum_shapes(self, info):
        return {**super().sum_shapes(info), "top2": ()}

    def sums(self, outputs, target):
        top2 = (outputs.topk(2, dim=1).indices == target[:, None]).any(dim=1).sum()
        return {**super().sums(outputs, target), "top2": top2}

    def compute(self, sums):
        return {**super().compute(sums), "top2": float(sums["top2"]) / float(sums["count"])}


def one_process_trainer(tmp_path: Path, task, monitor: str = "val/loss", mode: str = "min") -> Trainer:  # noqa: ANN001
    """A one-process trainer of a Linear(4, 3) over `tiny_data`, validated on its samples, saving no checkpoint."""
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = tiny_data(grad_accum=1)
    data = Data(splits=data.splits, train_sampler=data.train_sampler, train_loader=data.train_loader,
                val_loader=TensorBatchLoader(data.splits.val, [list(range(GLOBAL_BATCH * STEPS))], torch.device("cpu")),
                num_val_samples=GLOBAL_BATCH * STEPS)
    runtime = Runtime(DistEnv(), torch.device("cpu"), backend=None)
    return Trainer(TrainerConfig(epochs=1, save_checkpoints=False, monitor=monitor, monitor_mode=mode),
                   one_model_parts(runtime, task, model, model, optimizer,
                                   torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), data,
                                   FileStore(tmp_path / "checkpoints", True),
                                   Reporter(tmp_path, True, tensorboard=False)))


def test_an_added_metric_is_reported_for_train_and_val(tmp_path: Path):
    trainer = one_process_trainer(tmp_path, WithTop2(), monitor="val/top2", mode="max")
    state = TrainState()
    trainer.fit(state)
    record = state.history[-1]
    assert 0 < record["train/top2"] <= 1 and record["train/acc"] <= record["train/top2"]
    assert record["val/acc"] <= record["val/top2"] <= 1 and state.best == record["val/top2"]
    summary = json.loads((tmp_path / "metrics.json").read_text())
    assert summary["val/top2"] == record["val/top2"]


def test_a_dataset_without_a_test_split_ends_the_run_untested_and_says_how_to_get_one(tmp_path: Path, caplog):
    trainer = one_process_trainer(tmp_path, Classification())
    state = TrainState()
    with caplog.at_level(logging.INFO, logger="src.loop.trainer"):
        assert trainer.fit(state) is Outcome.COMPLETED
    assert state.test is None and not [key for key in json.loads((tmp_path / "metrics.json").read_text())
                                       if key.startswith("test")]
    assert ("the dataset has no test split: the run ends without a test (a test/ folder beside train/ gives one to "
            "dataset=image_folder, DataSplits(test=...) to a builder of yours)") in caplog.messages


def test_a_loop_state_loads_the_fields_it_knows_and_keeps_defaults_for_the_others():
    """A field the state does not have (`stopped_early`) is ignored; one the saved state lacks keeps its default."""
    old = {"epoch": 1, "step": 25, "best": 0.5, "train_samples": 1600, "train_seconds": 2.0,
           "history": [{"epoch": 1}], "step_in_epoch": 3, "epoch_totals": None, "stopped_early": False}
    state = TrainState()
    state.load_state_dict(old)
    assert (state.epoch, state.step, state.step_in_epoch, state.best) == (1, 25, 3, 0.5)
    assert "stopped_early" not in vars(state) and state.ended is None


def test_a_run_at_its_max_steps_takes_no_further_step(tmp_path: Path):
    """As a resume with the `trainer.max_steps` the run stopped at (a requeued job's same command, a preset's
    value): it stops again at once, with the same weights."""
    trainer = one_process_trainer(tmp_path, Classification())
    trainer.config = dataclasses.replace(trainer.config, max_steps=2)
    state = TrainState()
    assert trainer.fit(state) is Outcome.MAX_STEPS and state.step == 2
    model = trainer.parts.modules["model"]
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    assert trainer.fit(state) is Outcome.MAX_STEPS and state.step == 2
    assert all(torch.equal(tensor, model.state_dict()[name]) for name, tensor in weights.items())


class FailingTask(Classification):
    def train_step(self, step) -> None:  # noqa: ANN001 - the task's hook
        raise RuntimeError("a fork's step failed")


@pytest.mark.parametrize("task", [Classification, FailingTask])
def test_fit_closes_the_data_however_it_ends(tmp_path: Path, task: type[Classification]):
    """The loaders' workers end with fit() (Data.close, tests/unit/data/test_data.py), also when it raises: a sweep's
    next job runs in this process."""
    trainer = one_process_trainer(tmp_path, task())
    closed = []
    real_close = trainer.parts.data.close
    trainer.parts.data.close = lambda: closed.append(real_close())
    if task is FailingTask:
        with pytest.raises(RuntimeError, match="a fork's step failed"):
            trainer.fit(TrainState())
    else:
        assert trainer.fit(TrainState()) is Outcome.COMPLETED
    assert closed == [None]
