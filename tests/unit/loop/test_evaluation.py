"""src/loop/evaluation.py and src/common/seeding.py on one process (the precision names: test_precision.py)."""

import pytest
import torch
import torch.nn.functional as F

from src.common.seeding import seed_everything, step_seed
from src.components.tasks import Classification, Regression
from src.loop.trainer import evaluate as evaluate_task


def evaluate(model, batches, task, info, device):
    """The task's evaluation of a run of one model over `batches` (the val split's, from sample 0)."""
    return evaluate_task(task, {"model": model}, lambda split: (batches, 0), info, device)


def test_evaluate_matches_a_direct_computation_and_restores_train_mode():
    seed_everything(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    model.train()
    x, y = torch.randn(23, 4), torch.randint(0, 3, (23,))
    batches = [(x[:10], y[:10]), (x[10:], y[10:])]
    result = evaluate(model, batches, Classification(), {"num_classes": 3}, torch.device("cpu"))
    assert model.training  # left as it was
    model.eval()
    with torch.no_grad():
        logits = model(x)
    assert result["count"] == 23
    assert result["loss"] == pytest.approx(F.cross_entropy(logits, y).item(), abs=1e-6)
    assert result["acc"] == (logits.argmax(1) == y).sum().item() / 23


def test_step_seeds_differ_by_rank_and_step_and_repeat():
    seeds = {step_seed(0, rank, step) for rank in range(8) for step in range(100)}
    assert len(seeds) == 800
    assert step_seed(3, 1, 2) == step_seed(3, 1, 2) != step_seed(4, 1, 2)
    # The formula checkpoints were made with (once named epoch_seed too), so a resumed run draws what
    # the interrupted one would have.
    assert step_seed(3, 1, 2) == (3 * 1_000_003 + 1 * 10_007 + 2) % 2**63
    seed_everything(7)
    first = torch.rand(3)
    seed_everything(7)
    assert torch.equal(first, torch.rand(3))


def test_step_seeding_repeats_torch_numpy_and_python_draws():
    import random

    import numpy as np

    from src.common.seeding import seed_generators

    def draw():
        return torch.rand(2).tolist(), float(np.random.rand()), random.random()

    seed_generators(11, torch.device("cpu"))
    first = draw()
    seed_generators(11, torch.device("cpu"))
    assert draw() == first
    seed_generators(12, torch.device("cpu"))
    assert draw() != first


def test_evaluate_counts_a_confusion_matrix_for_classification():
    seed_everything(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(23, 4), torch.randint(0, 3, (23,))
    info = {"num_classes": 3}
    result = evaluate(model, [(x[:10], y[:10]), (x[10:], y[10:])], Classification(), info, torch.device("cpu"))
    with torch.no_grad():
        predicted = model(x).argmax(1)
    expected = torch.zeros(3, 3, dtype=torch.int64)
    for true, guess in zip(y.tolist(), predicted.tolist()):
        expected[true, guess] += 1
    assert torch.equal(result["confusion"], expected)
    regression = evaluate(model, [(x, torch.randn(23, 3))], Regression(), {"num_targets": 3}, torch.device("cpu"))
    assert "confusion" not in regression and regression["count"] == 23  # a table only where it makes sense
