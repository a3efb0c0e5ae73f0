"""Tasks (src/components/tasks.py): batch structure, losses as sums, and metrics from sums that equal the
textbook (scikit-learn) values however the samples are split into batches or ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sklearn import metrics as skm

from src.common.errors import UsageError
from src.components.tasks import Binary, Classification, Regression
from src.loop.evaluation import metrics_of
from src.loop.metrics import MetricSums


def summed(task, info, outputs, targets, chunks=(0, 5, 6, 17, None)):
    """The task's metrics over `outputs`/`targets` fed in uneven batches (as uneven rank shards would be)."""
    sums = MetricSums(task.sum_shapes(info), torch.device("cpu"))
    bounds = list(chunks[:-1]) + [len(targets)]
    for start, stop in zip(bounds, bounds[1:]):
        loss, count = task.loss(outputs[start:stop], targets[start:stop]), task.count(targets[start:stop])
        sums.add(task.batch_sums(outputs[start:stop], targets[start:stop], loss, count))
    return metrics_of(task, sums.reduce())


def test_binary_metrics_equal_scikit_learns():
    torch.manual_seed(0)
    logits, labels = torch.randn(29, 1), torch.randint(0, 2, (29,))
    result = summed(Binary(), {"num_classes": 2}, logits, labels)
    predicted = (logits.squeeze(1) > 0).long().numpy()
    assert result["acc"] == pytest.approx(skm.accuracy_score(labels, predicted), abs=1e-12)
    assert result["precision"] == pytest.approx(skm.precision_score(labels, predicted), abs=1e-12)
    assert result["recall"] == pytest.approx(skm.recall_score(labels, predicted), abs=1e-12)
    assert result["f1"] == pytest.approx(skm.f1_score(labels, predicted), abs=1e-12)
    bce = F.binary_cross_entropy_with_logits(logits.squeeze(1), labels.float())
    assert result["loss"] == pytest.approx(bce.item(), abs=1e-6) and result["count"] == 29


def test_binary_pos_weight_is_torchs_for_0_1_labels():
    torch.manual_seed(3)
    logits, labels = torch.randn(17), torch.randint(0, 2, (17,))
    loss, count = Binary(pos_weight=3.0).loss(logits, labels), Binary().count(labels)
    expected = F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="sum",
                                                  pos_weight=torch.tensor(3.0))
    assert count == 17 and loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_binary_without_positive_predictions_has_zero_precision_like_scikit_learn():
    result = summed(Binary(), {"num_classes": 2}, -torch.ones(8), torch.tensor([0, 1] * 4))
    assert (result["precision"], result["recall"], result["f1"], result["acc"]) == (0.0, 0.0, 0.0, 0.5)


@pytest.mark.parametrize("loss", ["l1", "mse"])
def test_regression_metrics_equal_scikit_learns_for_several_outputs(loss: str):
    torch.manual_seed(1)
    targets = torch.randn(31, 3) * torch.tensor([1.0, 5.0, 0.2]) + torch.tensor([0.0, 3.0, -1.0])
    outputs = targets + 0.3 * torch.randn(31, 3)
    result = summed(Regression(loss=loss), {"num_targets": 3}, outputs, targets)
    y, p = targets.double().numpy(), outputs.double().numpy()
    assert result["mae"] == pytest.approx(skm.mean_absolute_error(y, p), abs=1e-6)
    assert result["rmse"] == pytest.approx(skm.mean_squared_error(y, p) ** 0.5, abs=1e-6)
    assert result["r2"] == pytest.approx(skm.r2_score(y, p, multioutput="variance_weighted"), abs=1e-6)
    expected_loss = result["mae"] if loss == "l1" else result["rmse"] ** 2  # per sample: the mean over its values
    assert result["loss"] == pytest.approx(expected_loss, abs=1e-6)


def test_regression_refuses_an_output_width_that_would_broadcast():
    with pytest.raises(UsageError, match="the model gives 1 outputs per sample but the target has 3 values"):
        Regression().loss(torch.zeros(4, 1), torch.zeros(4, 3))
    with pytest.raises(UsageError, match="the model gives 1 outputs per sample but the target has 3 values"):
        Regression().check_output(torch.zeros(4, 1), torch.zeros(4, 3))
    with pytest.raises(UsageError, match="task.loss=huber is not one of l1, mse"):
        Regression(loss="huber")


def test_classification_loss_is_a_sum_and_acc_a_ratio_of_sums():
    torch.manual_seed(2)
    logits, labels = torch.randn(23, 4), torch.randint(0, 4, (23,))
    result = summed(Classification(), {"num_classes": 4}, logits, labels)
    assert result["loss"] == pytest.approx(F.cross_entropy(logits, labels).item(), abs=1e-6)
    assert result["acc"] == (logits.argmax(1) == labels).sum().item() / 23


def test_batches_of_any_structure_give_positional_or_keyword_inputs():
    rgb, mask, target = torch.zeros(2, 3, 4, 4), torch.ones(2, 1, 4, 4), torch.zeros(2, 1)
    assert Regression(inputs=[0, 1], target=2).split((rgb, mask, target)) == ((rgb, mask), {}, target)
    batch = {"rgb": rgb, "mask": mask, "y": target}
    args, kwargs, picked = Regression(inputs={"image": "rgb", "mask": "mask"}, target="y").split(batch)
    assert args == () and kwargs == {"image": rgb, "mask": mask} and picked is target


def test_tasks_say_what_they_need_of_a_dataset():
    digits = {"num_classes": 10, "in_channels": 1}
    assert Classification().check(digits) is None and Classification().num_outputs(digits) == 10
    assert "two classes" in Binary().check(digits)
    assert Binary().check({"num_classes": 2}) is None and Binary().num_outputs({"num_classes": 2}) == 1
    assert "real-valued targets" in Regression().check(digits)
    assert Regression().num_outputs({"num_targets": 3}) == 3 and "class labels" in Classification().check(
        {"num_targets": 1})
