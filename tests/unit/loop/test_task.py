"""Binding a task's inputs and target to a dataset's named fields (src/loop/task.py, src/loop/task_and_model.py): by
default the target field is the target and the rest are the model's inputs, in order; names, positions and
{arg: field} mappings still work; a dataset that names nothing is bound by position; every mistake is one line."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import TensorDataset

from src.common.errors import UsageError
from src.components import datasets
from src.components.models import SimpleCNN, TwoInputCNN
from src.components.tasks import Binary, Classification, Regression
from src.data.splits import DataSplits
from src.loop.task_and_model import bind_to_dataset, build_model, check_fit, check_inputs, check_task, output_setting

RGB, MASK, TARGET = torch.zeros(2, 3, 4, 4), torch.ones(2, 1, 4, 4), torch.full((2, 1), 0.5)
FIELDS = ("rgb", "mask", "target")


def bound(task, fields=FIELDS, target="target", sample=None, dataset="dataset=scenes"):
    task.bind(fields, target, sample, dataset)
    return task


def test_by_default_the_target_field_is_the_target_and_the_rest_are_inputs_in_order():
    task = bound(Regression())
    assert task.split((RGB, MASK, TARGET)) == ((RGB, MASK), {}, TARGET)
    args, kwargs, target = task.split({"target": TARGET, "mask": MASK, "rgb": RGB})  # dict samples: by key
    assert args == (RGB, MASK) and kwargs == {} and target is TARGET
    # The target need not be the last field.
    task = bound(Regression(), fields=("target", "rgb", "mask"), target="target")
    assert task.split((TARGET, RGB, MASK)) == ((RGB, MASK), {}, TARGET)


def test_a_dataset_without_a_named_target_learns_its_last_field():
    assert bound(Regression(), target=None).split((RGB, MASK, TARGET)) == ((RGB, MASK), {}, TARGET)


@pytest.mark.parametrize("inputs,target", [([0, 1], 2), (["rgb", "mask"], "target"), (["rgb", 1], 2)])
def test_positional_lists_of_positions_or_names_still_work(inputs, target):
    task = bound(Regression(inputs=inputs, target=target))
    assert task.split((RGB, MASK, TARGET)) == ((RGB, MASK), {}, TARGET)
    args, _, picked = task.split(dict(zip(FIELDS, (RGB, MASK, TARGET))))  # positions of named fields, in dicts
    assert args == (RGB, MASK) and picked is TARGET


def test_an_arg_to_field_mapping_gives_keyword_inputs():
    task = bound(Regression(inputs=OmegaConf.create({"image": "rgb", "mask": "mask"}), target="target"))
    assert task.split((RGB, MASK, TARGET)) == ((), {"image": RGB, "mask": MASK}, TARGET)


def test_a_fork_dataset_that_names_nothing_is_bound_by_position():
    task = bound(Regression(), fields=None, target=None, sample=(RGB[0], MASK[0], TARGET[0]))
    assert task.split((RGB, MASK, TARGET)) == ((RGB, MASK), {}, TARGET)
    # A fork's dict samples with its own keys and settings, as the README's fork example.
    task = bound(Regression(inputs={"rgb": "rgb"}, target="y"), fields=None, target=None,
                 sample={"rgb": RGB[0], "y": TARGET[0]})
    assert task.split({"rgb": RGB, "y": TARGET}) == ((), {"rgb": RGB}, TARGET)
    # One name or position, as `task.inputs=rgb` gives it: that one input (its letters, before).
    for one in ("rgb", 0):
        task = bound(Regression(inputs=one), fields=FIELDS, target="target")
        assert task.inputs == [one] and task.split((RGB, MASK, TARGET)) == ((RGB,), {}, TARGET)
    # Never bound to a dataset (unit tests, scripts): the first batch's structure, as above.
    assert Regression().split((RGB, MASK, TARGET)) == ((RGB, MASK), {}, TARGET)


@pytest.mark.parametrize("task,fields,target,sample,message", [
    (Regression(target="labl"), FIELDS, "target", None,
     "task.target names the field 'labl', which dataset=scenes does not have: its fields are rgb, mask, target; "
     "set task.target to one of them"),
    (Regression(inputs=["rgb", "depth"]), FIELDS, "target", None,
     "task.inputs names the field 'depth', which dataset=scenes does not have"),
    (Regression(inputs=[0, 3]), FIELDS, "target", None,
     "task.inputs=3 is not a position of dataset=scenes's samples, which have fields rgb, mask, target"),
    (Regression(target="target"), None, None, (RGB[0], TARGET[0]),
     "task.target names the field 'target', but dataset=scenes names no fields (its samples are tuples of 2 parts): "
     "use positions, e.g. task.target=0"),
    (Regression(), None, None, {"rgb": RGB[0], "y": TARGET[0]},
     "dataset=scenes gives dict samples (rgb, y) and names no target: set task.target=KEY (one of those keys)"),
    (Regression(), None, None, (RGB[0],), "dataset=scenes's samples have 1 part(s): none is left for the model"),
])
def test_a_name_or_position_the_dataset_does_not_have_is_one_line(task, fields, target, sample, message):
    with pytest.raises(UsageError) as error:
        bound(task, fields, target, sample)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_samples_of_another_length_than_the_fields_are_refused_in_one_line():
    task = bound(Regression(), fields=("rgb", "target"))
    with pytest.raises(UsageError, match=r"dataset=scenes names 2 fields \(rgb, target\) but its samples have 3 "):
        task.split((RGB, MASK, TARGET))


def test_the_model_must_take_the_inputs_the_task_binds():
    splits = DataSplits(TensorDataset(RGB, MASK, TARGET), TensorDataset(RGB, MASK, TARGET), {"num_targets": 1},
                        fields=FIELDS, target="target")
    task = Regression()
    bind_to_dataset(task, splits, "dataset=two_input_synthetic")
    check_inputs(TwoInputCNN(3, 1), task)  # model(rgb, mask): fits
    with pytest.raises(UsageError) as error:
        check_inputs(SimpleCNN(3, (4, 4), 1), task)
    assert str(error.value).startswith(
        "SimpleCNN.forward(x) cannot take the task's inputs model(rgb, mask) (too many positional arguments) from "
        "dataset=two_input_synthetic's fields rgb, mask, target (target: target): set task.inputs=[FIELD,...]")
    task = Regression(inputs=["rgb"])
    bind_to_dataset(task, splits, "dataset=two_input_synthetic")
    with pytest.raises(UsageError, match=r"TwoInputCNN.forward\(rgb, mask\) cannot take the task's inputs "
                                         r"model\(rgb\) \(missing a required argument: 'mask'\)"):
        check_inputs(TwoInputCNN(3, 1), task)


def test_the_output_check_names_the_model_key_that_takes_num_outputs():
    assert output_setting(OmegaConf.create({"_target_": "torch.nn.Linear", "in_features": 3,
                                            "out_features": "${data:num_outputs}"})) == "model.out_features"
    assert output_setting(OmegaConf.create({"_target_": "x.Net", "width": 3})) == "model.num_outputs"
    splits = DataSplits(TensorDataset(torch.zeros(4, 3), torch.zeros(4, dtype=torch.int64)), [],
                        {"num_classes": 5, "num_features": 3}, fields=("features", "label"), target="label")
    task = Classification()
    bind_to_dataset(task, splits, "dataset=table")
    model = build_model(OmegaConf.create({"_target_": "torch.nn.Linear", "in_features": 3, "out_features": 4}), task)
    assert isinstance(model, nn.Linear) and task.output_width == 5
    with pytest.raises(UsageError, match=r"returns \(4, 4\): build it with model.num_outputs=5"):
        task.check_output(model(torch.zeros(4, 3)), torch.zeros(4, dtype=torch.int64))


def test_a_dataset_that_names_nothing_is_looked_at_without_moving_the_random_state():
    class Augmenting(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return torch.rand(3), torch.tensor(0)  # a random transform draws from the global generator

    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    task = Classification()
    bind_to_dataset(task, DataSplits(Augmenting(), Augmenting(), {"num_classes": 2}), "dataset=fork")
    assert torch.equal(torch.rand(1), expected)
    assert task.binding.args == (0,) and task.binding.target == 1


def test_a_dataset_the_task_cannot_learn_from_names_both_once_and_what_to_do():
    """train.py's line names the options chosen (the task's class where no option is); eval.py's names the
    checkpoint's task and its own advice (it cannot choose another task). `dataset=dataset=...` and
    `dataset=this dataset` before."""
    splits = DataSplits(TensorDataset(RGB, TARGET), TensorDataset(RGB, TARGET), {"num_features": 10, "num_targets": 1})
    with pytest.raises(UsageError) as error:
        check_task(Classification(), splits, {"task": "classification", "dataset": "diabetes"}, None)
    assert str(error.value) == (
        "task=classification needs class labels (num_classes), but dataset=diabetes provides num_features=10, "
        "num_targets=1: choose a task this dataset fits (classification needs num_classes, binary num_classes=2, "
        "regression num_targets) or a dataset that task=classification fits")
    with pytest.raises(UsageError, match=r"^task=Classification needs class labels \(num_classes\), but the dataset "):
        check_task(Classification(), splits, {}, None)
    digits = datasets.digits()  # the info dict `dataset=digits` reports, as train.py gets it
    for task, name, need in ((Regression(), "regression", "real-valued targets (num_targets)"),
                             (Binary(), "binary", "two classes (num_classes=2, labels 0/1)")):  # test_bad_input's rows
        with pytest.raises(UsageError) as error:
            check_task(task, digits, {"task": name, "dataset": "digits"}, None)
        assert str(error.value).startswith(f"task={name} needs {need}, but dataset=digits provides num_classes=10, "
                                           "in_channels=1, image_size=[8, 8], num_features=64: choose a task this "
                                           "dataset fits")
    with pytest.raises(UsageError) as error:
        check_fit(Classification(), splits.info, "the checkpoint's task (Classification)", "dataset=diabetes",
                  "evaluate it on a dataset that task fits")
    assert str(error.value) == ("the checkpoint's task (Classification) needs class labels (num_classes), but "
                                "dataset=diabetes provides num_features=10, num_targets=1: evaluate it on a dataset "
                                "that task fits")
