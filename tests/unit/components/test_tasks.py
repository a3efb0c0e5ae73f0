"""Tasks (src/components/tasks.py): batch structure, losses as sums, and metrics from sums that equal the
textbook (scikit-learn) values however the samples are split into batches or ranks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from sklearn import metrics as skm

from src.common.errors import UsageError
from src.components.tasks import Binary, CausalLM, Classification, Regression, Segmentation
from src.loop.step import MetricSums
from src.loop.trainer import metrics_of


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


def test_causal_lm_averages_over_tokens_that_are_not_padding():
    torch.manual_seed(4)
    logits, targets = torch.randn(9, 6, 11), torch.randint(0, 11, (9, 6))
    targets[torch.rand(9, 6) < 0.4] = -100  # padding: every sequence holds another number of tokens
    task = CausalLM()
    result = summed(task, {"vocab_size": 11}, logits, targets, chunks=(0, 2, 3, 7, None))
    tokens = int((targets != -100).sum())
    assert task.unit == "tokens" and result["count"] == tokens and int(task.count(targets)) == tokens
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    assert result["loss"] == pytest.approx(expected.item(), abs=1e-6)
    assert result["perplexity"] == pytest.approx(math.exp(expected.item()), rel=1e-6)
    real = targets != -100
    assert result["acc"] == (logits.argmax(-1) == targets)[real].sum().item() / tokens
    assert isinstance(task.count(targets), torch.Tensor)  # on the device: summed over ranks with no host sync


def test_samples_are_counted_as_a_host_int():
    for task in (Classification(), Binary(), Regression()):
        assert task.unit == "samples" and task.count(torch.zeros(7, 3)) == 7 and isinstance(task.count(
            torch.zeros(7)), int)


def check(task, outputs_shape, target, width=None):
    task.output_width = width
    with pytest.raises(UsageError) as error:
        task.check_output(torch.zeros(outputs_shape), target)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_classification_refuses_per_position_logits_in_either_order_naming_both_shapes():
    tokens = torch.zeros(8, 16, dtype=torch.int64)
    for logits in ((8, 96, 16), (8, 16, 96)):  # (N, V, T) would train with a loss 16x too large; (N, T, V) crash
        message = check(Classification(), logits, tokens, width=96)
        assert f"shape (8, 16) (the model returns ({', '.join(map(str, logits))}))" in message
        assert "task=causal_lm" in message
    message = check(Classification(), (8, 5), torch.zeros(8, dtype=torch.int64), width=10)
    assert message == ("task=classification takes logits of shape (N, num_classes) = (8, 10) for targets of shape "
                       "(8,), but the model returns (8, 5): build it with model.num_outputs=10 (its YAML's "
                       "${data:num_outputs})")
    assert "int64 targets" in check(Classification(), (8, 10), torch.zeros(8), width=10)  # float targets
    Classification().check_output(torch.zeros(8, 10), torch.zeros(8, dtype=torch.int64))  # fits: no error


def test_binary_refuses_more_than_one_logit_per_sample():
    task = Binary()
    task.output_setting = "model.out_features"
    message = check(task, (6, 2), torch.zeros(6, dtype=torch.int64))
    assert message == ("task=binary takes one logit per sample, (N,) or (N, 1) = (6, 1) for targets of shape (6,), "
                       "but the model returns (6, 2): build it with model.out_features=1 (its YAML's "
                       "${data:num_outputs} gives 1)")
    assert "one 0/1 label per sample" in check(Binary(), (6, 1), torch.zeros(6, 3))
    Binary().check_output(torch.zeros(6, 1), torch.zeros(6, dtype=torch.int64))
    Binary().check_output(torch.zeros(6), torch.zeros(6, 1))


def test_regression_refuses_outputs_that_do_not_fit_its_targets():
    assert "(4, 1) for targets of shape (4, 1), but the model returns (3, 1)" in check(Regression(), (3, 1),
                                                                                       torch.zeros(4, 1))
    assert "holds int64 (class labels?)" in check(Regression(), (4, 1), torch.zeros(4, dtype=torch.int64))
    assert "build the model with model.num_outputs=2" in check(Regression(), (4, 3), torch.zeros(4, 2))
    Regression().check_output(torch.zeros(4), torch.zeros(4, 1))


def test_causal_lm_takes_logits_in_batch_position_vocabulary_order():
    tokens = torch.zeros(2, 5, dtype=torch.int64)
    message = check(CausalLM(), (2, 7, 5), tokens, width=7)
    assert message.startswith("task=causal_lm takes logits of shape (N, T, vocab_size) = (2, 5, 7) for targets of "
                              "shape (2, 5), but the model returns (2, 7, 5)")
    assert "model.num_outputs=7" in check(CausalLM(), (2, 5, 9), tokens, width=7)
    assert "token ids" in check(CausalLM(), (2, 5, 7), torch.zeros(2, 5), width=7)
    CausalLM().check_output(torch.zeros(2, 5, 7), tokens)


def test_every_task_names_what_a_model_returned_that_is_not_one_tensor():
    """A model returning (logits, extra), a dict or an object (a fork's model) is one line, not an AttributeError."""
    labels, masks = torch.zeros(8, dtype=torch.int64), torch.zeros(8, 4, 4, dtype=torch.int64)
    cases = [(Classification(), labels), (Binary(), labels), (Regression(), torch.zeros(8, 1)),
             (CausalLM(), torch.zeros(8, 5, dtype=torch.int64)), (Segmentation(), masks)]
    for task, target in cases:
        for outputs, returned in (((torch.zeros(8, 10), torch.tensor(0.5)), "a tuple of 2 ((8, 10), ())"),
                                  ([torch.zeros(8, 10), None], "a list of 2 ((8, 10), NoneType)"),
                                  ({"logits": torch.zeros(8, 10), "aux": 1}, "a dict of logits, aux"),
                                  (object(), "an object")):
            with pytest.raises(UsageError) as error:
                task.check_output(outputs, target)
            message = str(error.value)
            name = type(task).__name__.lower().replace("causallm", "causal_lm")
            assert message.startswith(f"task={name} takes the model's output as one tensor (") and "\n" not in message
            assert message.endswith(f"but the model returns {returned}: return that tensor alone, or write a task "
                                    "whose loss and sums take this output (docs/forking.md#add-a-task)")


# ---- segmentation: per-pixel cross-entropy over labelled pixels, exact IoU from whole-split sums ----------------


def standalone_segmentation_metrics(logits: torch.Tensor, masks: torch.Tensor, ignore: int) -> dict[str, float]:
    """Pixel accuracy, per-class IoU and mIoU of the whole split at once, from scikit-learn's confusion matrix."""
    labelled = masks != ignore
    predicted, actual = logits.argmax(dim=1)[labelled].numpy(), masks[labelled].numpy()
    classes = logits.shape[1]
    confusion = skm.confusion_matrix(actual, predicted, labels=list(range(classes)))
    intersection = confusion.diagonal()
    union = confusion.sum(axis=0) + confusion.sum(axis=1) - intersection
    iou = {f"iou_{c}": intersection[c] / union[c] if union[c] else math.nan for c in range(classes)}
    present = [value for value in iou.values() if not math.isnan(value)]
    return {"acc": intersection.sum() / labelled.sum().item(), "miou": sum(present) / len(present), **iou}


def test_segmentation_metrics_from_sums_equal_a_whole_split_recomputation_with_ignored_pixels():
    torch.manual_seed(0)
    classes, ignore = 5, 255
    logits = torch.randn(23, classes, 6, 7)
    masks = torch.randint(0, classes - 1, (23, 6, 7))  # class 4 never occurs in the targets
    masks[torch.rand(23, 6, 7) < 0.2] = ignore
    logits[:, 3] -= 100.0  # and class 3 is never predicted
    task = Segmentation(ignore_index=ignore)
    task.output_width = classes
    task.check_output(logits, masks)
    result = summed(task, {"num_classes": classes}, logits, masks)
    expected = standalone_segmentation_metrics(logits, masks, ignore)
    for name, value in expected.items():
        assert result[name] == pytest.approx(value, abs=1e-12, nan_ok=True), name
    assert math.isnan(result["iou_4"]) is False and result["iou_4"] == 0.0  # predicted, never true: IoU 0, counted
    labelled = masks != ignore
    assert result["count"] == int(labelled.sum())
    loss = F.cross_entropy(logits, masks, ignore_index=ignore, reduction="sum") / labelled.sum()
    assert result["loss"] == pytest.approx(float(loss), rel=1e-6)


def test_segmentation_reads_a_dict_output_and_refuses_wrong_shapes_in_one_line():
    task = Segmentation()
    task.output_width, task.output_setting = 4, "model.num_outputs"
    masks = torch.randint(0, 4, (2, 8, 8))
    task.check_output({"out": torch.randn(2, 4, 8, 8), "aux": torch.randn(2, 4, 8, 8)}, masks)  # torchvision's
    assert task.loss({"out": torch.zeros(2, 4, 8, 8)}, masks) == pytest.approx(2 * 64 * math.log(4), rel=1e-6)
    with pytest.raises(UsageError, match=r"^task=segmentation takes logits of shape \(N, num_classes, H, W\) = "
                                         r"\(2, 4, 8, 8\) for masks of shape \(2, 8, 8\), but the model returns "
                                         r"\(2, 4, 4, 4\): build it with model.num_outputs=4 .* upsample"):
        task.check_output(torch.randn(2, 4, 4, 4), masks)
    with pytest.raises(UsageError, match=r"^task=segmentation takes a class index per pixel"):
        task.check_output(torch.randn(2, 4), torch.randint(0, 4, (2,)))


def test_classification_on_masks_names_task_segmentation():
    task = Classification()
    with pytest.raises(UsageError, match=r"for a class per pixel \(masks of shape \(N, H, W\)\) use task=segmentation"):
        task.check_output(torch.randn(2, 4, 8, 8), torch.randint(0, 4, (2, 8, 8)))
