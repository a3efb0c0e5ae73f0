"""The divisor of a step's loss (src/loop/step.py): the global count over every rank and micro-step.

Two ranks are simulated in one process: each rank's "all-reduce" of the step's count adds the other rank's
local count, which is what the collective does. The gradient the ranks then average (as DDP and FSDP do)
must be the gradient of the global per-unit mean, whatever each rank and micro-step holds; a real one-rank
gloo group runs the asynchronous collective itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from src.loop import step
from src.loop.step import StepDivisor

IGNORE = -100


def token_batches(seed: int = 0) -> list[list[torch.Tensor]]:
    """targets[rank][micro_step]: (4, 6) token targets, padded with IGNORE to a different length in each."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for rank, lengths in enumerate([[[6, 1, 2, 6], [3, 3, 0, 5]], [[1, 1, 1, 2], [6, 6, 6, 4]]]):
        per_rank = []
        for micro_lengths in lengths:
            target = torch.randint(0, 5, (4, 6), generator=generator)
            for row, length in enumerate(micro_lengths):
                target[row, length:] = IGNORE
            per_rank.append(target)
        batches.append(per_rank)
    return batches


def loss_sum(weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A per-token cross-entropy summed over non-pad tokens, of logits that depend on `weight` (5 classes)."""
    positions = torch.arange(target.shape[1], dtype=torch.float32)
    logits = positions[None, :, None] * weight[None, None, :] + weight[None, None, :] ** 2
    return torch.nn.functional.cross_entropy(logits.expand(*target.shape, 5).flatten(0, 1), target.flatten(),
                                             ignore_index=IGNORE, reduction="sum")


def rank_gradient(weight: torch.Tensor, targets: list[torch.Tensor], other_count: int) -> torch.Tensor:
    """One rank's gradient over its micro-steps, its count all-reduced with the other rank's `other_count`."""
    def all_reduce_with_the_other_rank(tensor: torch.Tensor) -> None:
        tensor.add_(other_count)  # in place, as the collective sums

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step, "start_all_reduce", all_reduce_with_the_other_rank)
        divisor = StepDivisor([(target != IGNORE).sum() for target in targets], world_size=2)
    weight.grad = None
    for target in targets:
        divisor(loss_sum(weight, target)).backward()
    return weight.grad.clone()


def test_two_ranks_with_unequal_counts_per_rank_and_micro_step_get_the_global_mean_gradient():
    targets = token_batches()
    counts = [[int((t != IGNORE).sum()) for t in rank] for rank in targets]
    assert len({count for rank in counts for count in rank}) == 4  # every rank and micro-step holds another count
    weight = torch.randn(5, generator=torch.Generator().manual_seed(1), requires_grad=True)
    per_rank = [rank_gradient(weight, targets[rank], sum(counts[1 - rank])) for rank in (0, 1)]
    averaged = (per_rank[0] + per_rank[1]) / 2  # what DDP's all-reduce of the gradients does
    weight.grad = None
    everything = torch.cat([t for rank in targets for t in rank])
    (loss_sum(weight, everything) / (everything != IGNORE).sum()).backward()
    assert torch.allclose(averaged, weight.grad, rtol=1e-6, atol=1e-7), (averaged, weight.grad)
    # The negative control: dividing by each rank's local count gives another gradient.
    local = [rank_gradient(weight, targets[rank], 0) / 2 for rank in (0, 1)]
    assert (local[0] + local[1] - weight.grad).abs().max() > 1e-2


def test_host_int_counts_keep_the_arithmetic_of_samples_bit_for_bit():
    loss = torch.tensor(7.123456, dtype=torch.float32)
    divisor = StepDivisor([16, 16, 16], world_size=2)
    assert divisor.global_count is None  # no collective for samples: every rank holds 16 per micro-step
    assert torch.equal(divisor(loss), loss / (16 * 3))


def test_a_step_with_no_unit_at_all_adds_nothing():
    divisor = StepDivisor([torch.tensor(0), torch.tensor(0)], world_size=1)
    assert divisor(torch.tensor(0.0)).item() == 0.0


@pytest.fixture
def one_rank_group(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_tensor_counts_are_all_reduced_asynchronously_in_a_real_group(one_rank_group):
    divisor = StepDivisor([torch.tensor(3), 4, torch.tensor(5)], world_size=1)
    assert divisor._pending is not None  # launched when built: before the first forward
    assert divisor(torch.tensor(24.0)).item() == pytest.approx(2.0)
    assert int(divisor.global_count) == 12


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to see host syncs")
def test_counting_tokens_does_not_sync_with_the_gpu():
    targets = [target.cuda() for target in token_batches()[0]]
    loss = torch.tensor(5.0, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        divisor = StepDivisor([(target != IGNORE).sum() for target in targets], world_size=1)
        scaled = divisor(loss)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert scaled.item() == pytest.approx(5.0 / sum(int((t != IGNORE).sum()) for t in targets))
