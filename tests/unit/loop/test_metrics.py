"""Metric sums (src/loop/step.py) with the classification task's metrics, on one process and summed
over a group of two gloo processes."""

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from src.common.errors import UsageError
from src.components.tasks import Classification
from src.loop import step
from src.loop.step import MetricSums
from src.loop.trainer import metrics_of

TASK = Classification()
INFO = {"num_classes": 3}


def classification_sums(val: bool = False) -> MetricSums:
    shapes = {**TASK.sum_shapes(INFO), **(TASK.val_sum_shapes(INFO) if val else {})}
    return MetricSums(shapes, torch.device("cpu"))


def add_batch(sums: MetricSums, logits: torch.Tensor, targets: torch.Tensor, loss_sum=None, val=False) -> None:
    loss_sum = F.cross_entropy(logits, targets, reduction="sum") if loss_sum is None else loss_sum
    sums.add(TASK.batch_sums(logits, targets, loss_sum, targets.shape[0], val=val))


def compute(sums: MetricSums, baseline=None) -> dict:
    return metrics_of(TASK, sums.reduce(baseline))


def test_metrics_are_sample_weighted_over_batches_of_any_size():
    torch.manual_seed(0)
    logits = torch.randn(37, 3)
    targets = torch.randint(0, 3, (37,))
    sums = classification_sums()
    for start, stop in [(0, 3), (3, 30), (30, 37)]:
        add_batch(sums, logits[start:stop], targets[start:stop])
    result = compute(sums)
    assert result["count"] == 37
    assert result["loss"] == pytest.approx(F.cross_entropy(logits, targets).item(), abs=1e-6)
    assert result["acc"] == (logits.argmax(1) == targets).sum().item() / 37


def test_reset_and_empty():
    sums = classification_sums()
    add_batch(sums, torch.eye(3), torch.tensor([0, 1, 0]), torch.tensor(1.5))
    assert compute(sums) == {"loss": 0.5, "acc": 2 / 3, "count": 3}
    sums.reset()
    empty = compute(sums)
    assert empty["count"] == 0 and empty["loss"] != empty["loss"]


def test_a_window_is_the_difference_from_its_baseline():
    sums = classification_sums()
    add_batch(sums, torch.eye(2, 3), torch.tensor([0, 1]), torch.tensor(4.0))
    baseline = sums.totals()
    add_batch(sums, torch.eye(3), torch.tensor([0, 0, 0]), torch.tensor(3.0))
    assert compute(sums, baseline=baseline) == {"loss": 1.0, "acc": 1 / 3, "count": 3}
    assert compute(sums) == {"loss": 7 / 5, "acc": 3 / 5, "count": 5}


def test_sums_are_saved_and_restored_by_name():
    sums = classification_sums()
    add_batch(sums, torch.eye(3), torch.tensor([0, 1, 0]), torch.tensor(1.5))
    saved = sums.state_dict()
    assert saved == {"loss": [1.5], "count": [3.0], "correct": [2.0]}
    restored = classification_sums()
    restored.load_state_dict(dict(reversed(list(saved.items()))))  # by name, whatever the order
    assert compute(restored) == compute(sums)
    with pytest.raises(UsageError, match="not this task's"):
        restored.load_state_dict({"loss": [1.0], "count": [2.0], "abs_error": [0.5]})


# Predictions (argmax of one-hot logits) and true classes of 7 samples over 3 classes.
PREDICTED = torch.tensor([0, 1, 1, 2, 0, 2, 2])
TRUE = torch.tensor([0, 1, 2, 2, 1, 2, 0])
CONFUSION = torch.tensor([[1, 0, 1],  # row: true class; column: predicted class
                          [1, 1, 0],
                          [0, 1, 2]])


def confusion_sums(samples: slice, batch_size: int) -> MetricSums:
    """Val sums over PREDICTED/TRUE[samples], fed in batches of `batch_size`."""
    sums = classification_sums(val=True)
    logits, targets = F.one_hot(PREDICTED[samples], 3).float(), TRUE[samples]
    for start in range(0, len(targets), batch_size):
        add_batch(sums, logits[start:start + batch_size], targets[start:start + batch_size], torch.tensor(0.0),
                  val=True)
    return sums


def test_confusion_matrix_counts_true_against_predicted_classes():
    sums = confusion_sums(slice(None), batch_size=3)
    result = compute(sums)
    assert torch.equal(result["confusion"], CONFUSION) and result["confusion"].dtype == torch.int64
    assert result["acc"] == CONFUSION.trace().item() / CONFUSION.sum().item() and result["count"] == 7
    sums.reset()
    assert not compute(sums)["confusion"].any()


def test_all_sums_and_the_confusion_matrix_ride_one_collective(monkeypatch):
    calls = []

    def counting_all_reduce(tensor):
        calls.append(tensor.numel())
        return tensor

    monkeypatch.setattr(step, "all_reduce_sum", counting_all_reduce)
    compute(confusion_sums(slice(None), batch_size=7))
    assert calls == [3 + 3 * 3]  # loss, count, correct, then the 3 x 3 matrix


def _confusion_worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    # Shards of different sizes (4 and 3 samples) and batch sizes, as EvalShardSampler gives.
    shard, batch_size = [(slice(0, 4), 3), (slice(4, 7), 2)][rank]
    torch.save(compute(confusion_sums(shard, batch_size)), Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_confusion_matrix_over_two_ranks_counts_every_sample_once(tmp_path: Path):
    mp.spawn(_confusion_worker, args=(str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(result["confusion"], CONFUSION)  # every rank gets the whole matrix
        assert result["count"] == 7 and result["acc"] == 4 / 7
