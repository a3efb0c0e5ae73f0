"""The NaN/inf guard: the first bad step is remembered on the device and reported exactly."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from src.callbacks.divergence import NonFiniteLossWatch, TrainingDiverged
from src.common.errors import UsageError


def test_finite_losses_pass_and_the_first_bad_step_is_named():
    watch = NonFiniteLossWatch(torch.device("cpu"))
    watch.observe(torch.tensor(1.5), step=1)
    watch.check(1.5)
    watch.check_now()  # nothing bad yet
    watch.observe(torch.tensor(float("inf")), step=7)
    watch.observe(torch.tensor(float("nan")), step=9)  # later bad steps do not move the first
    watch.observe(torch.tensor(0.5), step=10)
    watch.check(2.0)  # a finite host value does not look further (no collective)
    with pytest.raises(TrainingDiverged, match=r"at optimizer step 7;.*optimizer\.lr") as raised:
        watch.check(math.nan)
    assert isinstance(raised.value, UsageError)  # reported as one line, exit code 2


def test_any_bad_element_counts():
    watch = NonFiniteLossWatch(torch.device("cpu"))
    watch.observe(torch.tensor([1.0, float("-inf"), 2.0]), step=3)
    with pytest.raises(TrainingDiverged, match="step 3;"):
        watch.check_now()


def _two_ranks(rank: int, init_file: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    watch = NonFiniteLossWatch(torch.device("cpu"))
    watch.observe(torch.tensor(1.0), step=4)
    if rank == 1:  # only rank 1's loss goes bad, at step 5
        watch.observe(torch.tensor(float("nan")), step=5)
    try:
        watch.check_now()
        results[rank] = "no error"
    except TrainingDiverged as error:
        results[rank] = str(error)
    dist.destroy_process_group()


def test_every_rank_stops_at_the_step_one_rank_went_bad(tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_two_ranks, args=(str(tmp_path / "rendezvous"), results), nprocs=2)
        messages = dict(results)
    assert set(messages) == {0, 1}
    assert all("at optimizer step 5;" in message for message in messages.values()), messages
