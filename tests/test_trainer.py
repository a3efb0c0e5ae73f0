"""Tests for src/trainer.py: what the loop asks of DDP on each micro-step.

A one-rank gloo group is enough to watch DDP's gradient all-reduce: a communication hook
runs exactly when DDP reduces, so counting its calls shows which micro-steps synchronise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

from src.checkpoint import Checkpointer
from src.data import Data, GlobalBatchSampler, TensorBatchLoader
from src.datasets import DataSplits
from src.distributed import DistEnv, Runtime
from src.reporting import Reporter
from src.trainer import Trainer, TrainerOptions, TrainState

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
    splits = DataSplits(train=dataset, val=dataset, num_classes=3, in_channels=1, image_size=(1, 4))
    cpu = torch.device("cpu")
    return Data(splits=splits, train_sampler=sampler, train_loader=TensorBatchLoader(dataset, sampler, cpu),
                val_loader=[], num_val_samples=0)


@pytest.mark.parametrize("grad_accum", [1, 2, 4])
def test_gradients_are_all_reduced_on_the_last_micro_step_only(one_rank_group, tmp_path: Path, grad_accum: int):
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
    trainer = Trainer(TrainerOptions(epochs=1, grad_accum=grad_accum), runtime, model, ddp, optimizer,
                      torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), tiny_data(grad_accum),
                      Checkpointer(tmp_path / "checkpoints", False), Reporter(tmp_path, False))
    state = TrainState()
    trainer.train_one_epoch(0, state)
    assert len(micro_steps) == STEPS * grad_accum and state.step == STEPS
    # Without no_sync every micro-step would all-reduce: STEPS * grad_accum calls.
    assert reduced_on == [grad_accum * (step + 1) for step in range(STEPS)]
