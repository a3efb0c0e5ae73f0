"""Metric accumulation, on one process and summed over a group of two gloo processes."""

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from src import metrics as metrics_module
from src.metrics import ClassificationMetrics


def test_metrics_are_sample_weighted_over_batches_of_any_size():
    torch.manual_seed(0)
    logits = torch.randn(37, 5)
    targets = torch.randint(0, 5, (37,))
    metrics = ClassificationMetrics(torch.device("cpu"))
    for start, stop in [(0, 3), (3, 30), (30, 37)]:
        batch_logits, batch_targets = logits[start:stop], targets[start:stop]
        metrics.update(batch_logits, batch_targets, F.cross_entropy(batch_logits, batch_targets, reduction="sum"))
    result = metrics.compute()
    assert result["count"] == 37
    assert result["loss"] == pytest.approx(F.cross_entropy(logits, targets).item(), abs=1e-6)
    assert result["acc"] == (logits.argmax(1) == targets).sum().item() / 37


def test_reset_and_empty():
    metrics = ClassificationMetrics(torch.device("cpu"))
    metrics.update(torch.eye(3), torch.tensor([0, 1, 0]), torch.tensor(1.5))
    assert metrics.compute() == {"loss": 0.5, "acc": 2 / 3, "count": 3}
    metrics.reset()
    empty = metrics.compute()
    assert empty["count"] == 0 and empty["loss"] != empty["loss"]


def test_a_window_is_the_difference_from_its_baseline():
    metrics = ClassificationMetrics(torch.device("cpu"))
    metrics.update(torch.eye(2), torch.tensor([0, 1]), torch.tensor(4.0))
    baseline = metrics.totals()
    metrics.update(torch.eye(3), torch.tensor([0, 0, 0]), torch.tensor(3.0))
    assert metrics.compute(baseline=baseline) == {"loss": 1.0, "acc": 1 / 3, "count": 3}
    assert metrics.compute() == {"loss": 7 / 5, "acc": 3 / 5, "count": 5}


# Predictions (argmax of one-hot logits) and true classes of 7 samples over 3 classes.
PREDICTED = torch.tensor([0, 1, 1, 2, 0, 2, 2])
TRUE = torch.tensor([0, 1, 2, 2, 1, 2, 0])
CONFUSION = torch.tensor([[1, 0, 1],  # row: true class; column: predicted class
                          [1, 1, 0],
                          [0, 1, 2]])


def confusion_metrics(samples: slice, batch_size: int) -> ClassificationMetrics:
    """Metrics over PREDICTED/TRUE[samples], fed in batches of `batch_size`."""
    metrics = ClassificationMetrics(torch.device("cpu"), num_classes=3)
    logits, targets = F.one_hot(PREDICTED[samples], 3).float(), TRUE[samples]
    for start in range(0, len(targets), batch_size):
        metrics.update(logits[start:start + batch_size], targets[start:start + batch_size], torch.tensor(0.0))
    return metrics


def test_confusion_matrix_counts_true_against_predicted_classes():
    metrics = confusion_metrics(slice(None), batch_size=3)
    result = metrics.compute()
    assert torch.equal(result["confusion"], CONFUSION) and result["confusion"].dtype == torch.int64
    assert result["acc"] == CONFUSION.trace().item() / CONFUSION.sum().item() and result["count"] == 7
    metrics.reset()
    assert not metrics.compute()["confusion"].any()


def test_totals_and_confusion_are_summed_in_one_collective(monkeypatch):
    calls = []

    def counting_all_reduce(tensor):
        calls.append(tensor.numel())
        return tensor

    monkeypatch.setattr(metrics_module, "all_reduce_sum", counting_all_reduce)
    confusion_metrics(slice(None), batch_size=7).compute()
    assert calls == [3 + 3 * 3]


def _confusion_worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    # Shards of different sizes (4 and 3 samples) and batch sizes, as EvalShardSampler gives.
    shard, batch_size = [(slice(0, 4), 3), (slice(4, 7), 2)][rank]
    torch.save(confusion_metrics(shard, batch_size).compute(), Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_confusion_matrix_over_two_ranks_counts_every_sample_once(tmp_path: Path):
    mp.spawn(_confusion_worker, args=(str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(result["confusion"], CONFUSION)  # every rank gets the whole matrix
        assert result["count"] == 7 and result["acc"] == 4 / 7
