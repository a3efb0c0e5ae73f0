"""Metric accumulation (single process; the all-reduced path is covered by the CLI tests)."""

import pytest
import torch
import torch.nn.functional as F

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
