"""Building what a config names (src/config/building.py): an argument the target does not take, or lacks, or a
value it refuses, is one line naming the config key; any other error of the target is left as it is."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from src.common.errors import UsageError
from src.config import building
from src.loop import task_and_model

CNN = {"_target_": "src.components.models.SimpleCNN", "in_channels": 1, "image_size": [8, 8], "num_outputs": 10}
TAKES = "src.components.models.SimpleCNN takes in_channels, image_size, num_outputs, channels, hidden, dropout"


def built(key: str, node: dict, passed_elsewhere=()):
    config = OmegaConf.create(node)
    with building.errors_named(key, config, passed_elsewhere):
        return instantiate(config)


@pytest.mark.parametrize("node, message", [
    ({**CNN, "foo": 1}, f"model.foo is not an argument of model: {TAKES}; remove it, or drop it for this run with "
                        "~model.foo"),
    ({key: value for key, value in CNN.items() if key != "num_outputs"},
     f"model needs num_outputs: {TAKES}; add +model.num_outputs=VALUE"),
])
def test_an_argument_the_target_does_not_take_or_lacks_is_one_line(node, message):
    with pytest.raises(UsageError) as error:
        built("model", node)
    assert str(error.value) == message


def test_keys_passed_elsewhere_are_not_arguments():
    digits = {"_target_": "src.components.datasets.digits", "val_size": 360, "batch_size": 64, "foo": 1}
    with pytest.raises(UsageError, match=r"^dataset.foo is not an argument of dataset: src.components.datasets.digits"):
        built("dataset", digits, passed_elsewhere=("batch_size",))


def test_a_value_a_callback_refuses_names_its_key():
    with pytest.raises(UsageError) as error:
        built("callbacks.early_stopping", {"_target_": "src.callbacks.early_stopping.EarlyStopping", "patience": 0,
                                           "min_delta": -1.0})
    assert str(error.value) == ("callbacks.early_stopping.patience=0 must be at least 1 (or null); "
                                "callbacks.early_stopping.min_delta=-1.0 must be a number >= 0")


def test_a_value_the_target_refuses_by_its_own_check_is_one_line_naming_where():
    """A ValueError while building (torch's Dropout here; a dataset builder's val_size check): the key, the target,
    torch's or the builder's words and where they were raised."""
    with pytest.raises(UsageError) as error:
        built("model", {**CNN, "dropout": 1.5})
    assert str(error.value) == ("model: src.components.models.SimpleCNN refused its settings (dropout probability has "
                                "to be between 0 and 1, but got 1.5; raised at dropout.py:25): change the model.* keys")


@pytest.mark.parametrize("node, message", [
    ({**CNN, "hidden": "abc"}, "model.hidden=abc: src.components.models.SimpleCNN takes hidden: int"),
    ({**CNN, "hidden": 1.5}, "model.hidden=1.5: src.components.models.SimpleCNN takes hidden: int"),
    ({**CNN, "dropout": "high"}, "model.dropout=high: src.components.models.SimpleCNN takes dropout: float"),
    ({**CNN, "channels": "ab"}, "model.channels=ab: src.components.models.SimpleCNN takes channels: Sequence[int]"),
    ({**CNN, "channels": 32}, "model.channels=32: src.components.models.SimpleCNN takes channels: Sequence[int]"),
    ({**CNN, "channels": [8, 1.5]}, "model.channels=[8, 1.5]: src.components.models.SimpleCNN takes channels: "
                                    "Sequence[int]"),
])
def test_a_value_of_a_type_the_target_s_annotation_rules_out_is_one_line(node, message):
    """Judged before the target is called: no TypeError from deep inside (`'<' not supported between 'str' and
    'int'`), and no value stored to fail at its first use."""
    with pytest.raises(UsageError) as error:
        built("model", node)
    assert str(error.value) == message


def test_a_value_first_read_by_a_training_step_is_judged_when_its_owner_is_built():
    """Classification stores label_smoothing and hands it to cross_entropy at the first step: refused here, before
    any step (task.label_smoothing=abc crashed at the first batch before)."""
    with pytest.raises(UsageError) as error:
        built("task", {"_target_": "src.components.tasks.Classification", "label_smoothing": "abc"})
    assert str(error.value) == "task.label_smoothing=abc: src.components.tasks.Classification takes label_smoothing: " \
                               "float"


@pytest.mark.parametrize("values, message", [
    ({"foreach": "yes"}, "k.foreach=yes: torch.optim.AdamW takes foreach: bool | None"),
    ({"amsgrad": 1}, "k.amsgrad=1: torch.optim.AdamW takes amsgrad: bool"),  # 1 is no bool, True no number
    ({"eps": True}, "k.eps=True: torch.optim.AdamW takes eps: float"),
    ({"eps": 1, "foreach": None, "amsgrad": False, "weight_decay": 0.1}, None),  # an int is a float's value
    ({"lr": "abc", "betas": ["a", "b"]}, None),  # float | Tensor, tuple[float | Tensor, ...]: types it does not judge
])
def test_the_annotations_judged_are_scalars_and_their_unions(values, message):
    assert refusal("k", {"_target_": "torch.optim.AdamW", **values}) == message
    assert refusal("k", {"_target_": "no.such.Target", **values}) is None  # unreadable: no guess


def refusal(key: str, node: dict) -> str | None:
    """check_types' line for `node`, or None if it passes."""
    try:
        building.check_types(key, node)
    except UsageError as error:
        return str(error)
    return None


def test_a_value_equal_to_the_class_s_own_default_is_never_refused(tmp_path: Path, monkeypatch):
    """A fork's loose annotation (`x: float = None`, implicit Optional) must not refuse its own default."""
    (tmp_path / "loose.py").write_text("class Loose:\n    def __init__(self, x: float = None, n: int = 2) -> None:\n"
                                       "        self.x, self.n = x, n\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert refusal("model", {"_target_": "loose.Loose", "x": None, "n": 2}) is None
    assert built("model", {"_target_": "loose.Loose", "x": None}).x is None
    assert refusal("m", {"_target_": "loose.Loose", "x": "abc"}) == "m.x=abc: loose.Loose takes x: float"


@pytest.mark.parametrize("hint, values, wrong", [
    (Sequence[int], ([8, 16], (8,), []), ("ab", 8, [8, "x"], [8, True], None)),
    (tuple[int, ...], ([1, 2, 3],), ([1.5],)),
    (list[float] | None, ([1, 2.5], None), ([None], "1.5")),
    (int | list[int], (3, [3]), ("3", [[3]])),
])
def test_sequences_of_scalars_are_judged_item_by_item(hint, values, wrong):
    assert [building.fits(value, hint) for value in values] == [True] * len(values)
    assert [building.fits(value, hint) for value in wrong] == [False] * len(wrong)


@pytest.mark.parametrize("hint", [tuple[int, str], list, Sequence, dict[str, int], Sequence[int] | torch.Tensor])
def test_other_annotations_are_not_judged(hint):
    assert building.fits("abc", hint) is None


@pytest.mark.parametrize("node, raised", [
    ({"_target_": "torch.nn.Linear", "in_features": 2, "out_features": -1}, "RuntimeError"),  # torch's own, well typed
    ({"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 2, "dtype": "half"}, "TypeError"),  # unannotated
])
def test_other_errors_of_the_target_keep_their_report(node, raised):
    with pytest.raises(Exception, match="Error in call to target") as error:
        built("model", node)
    assert not isinstance(error.value, UsageError) and type(error.value.__cause__).__name__ == raised


@pytest.mark.parametrize("target, message", [
    ("src.components.models.SimpleCNNN", "module src.components.models has no SimpleCNNN; did you mean "
                                         "src.components.models.SimpleCNN?"),
    ("src.components.modelz.SimpleCNN", "module src.components.modelz cannot be imported (ModuleNotFoundError: No "
                                        "module named 'src.components.modelz'); a module of your own needs "
                                        "PYTHONPATH=. (docs/forking.md)"),
    ("my_fork.models.Net", "module my_fork.models cannot be imported (ModuleNotFoundError: No module named 'my_fork'); "
                           "a module of your own needs PYTHONPATH=. (docs/forking.md)"),
])
def test_a_target_that_cannot_be_imported_is_one_line_naming_its_key(target, message):
    with pytest.raises(UsageError) as error:
        built("model.encoder", {**CNN, "_target_": target})
    assert str(error.value) == f"model.encoder._target_={target}: {message}"


def test_an_optimizer_that_cannot_be_imported_or_takes_no_key_is_one_line_naming_the_model_s_own_key():
    """Each model's own optimizer and schedule (optimizer.NAME, scheduler.NAME): their errors name those keys."""
    config = OmegaConf.create({"optimizer": {"model": {"_target_": "torch.optim.Adamm", "_partial_": True}},
                               "scheduler": {"model": {"_target_": "src.loop.optim.constant", "_partial_": True}}})
    modules = {"model": torch.nn.Linear(2, 1)}
    with pytest.raises(UsageError, match=r"^optimizer.model._target_=torch.optim.Adamm: module torch.optim has no "
                                         r"Adamm; did you mean torch.optim.Adam\?$"):
        task_and_model.build_optimizers(config, modules, steps_per_epoch=4, epochs=2)
    config.optimizer.model = {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1, "momentm": 0.9}
    with pytest.raises(UsageError, match=r"~optimizer.model.momentm$"):
        task_and_model.build_optimizers(config, modules, steps_per_epoch=4, epochs=2)
    config.optimizer.model.pop("momentm")
    config.scheduler.model.gama = 0.5
    with pytest.raises(UsageError, match=r"^scheduler.model.gama is not an argument of scheduler.model: "):
        task_and_model.build_optimizers(config, modules, steps_per_epoch=4, epochs=2)


ONE_CYCLE = {"_target_": "torch.optim.lr_scheduler.OneCycleLR", "_partial_": True}
ONE_CYCLE_TAKES = "torch.optim.lr_scheduler.OneCycleLR takes optimizer, max_lr, total_steps, epochs, steps_per_epoch"


@pytest.mark.parametrize("node, message", [
    ({**ONE_CYCLE, "max_lr": 0.1, "warmup_epochs": 1.0},
     f"scheduler.warmup_epochs is not an argument of scheduler: {ONE_CYCLE_TAKES}, "),
    (ONE_CYCLE, f"scheduler needs max_lr: {ONE_CYCLE_TAKES}, "),
    ({"_target_": "torch.optim.lr_scheduler.StepLR", "_partial_": True, "step_size": 2},
     "scheduler: torch.optim.lr_scheduler.StepLR takes optimizer, step_size, gamma, last_epoch, but the run calls it "
     "with optimizer, total_steps, steps_per_epoch: give a callable that takes them (docs/forking.md)"),
    ({**ONE_CYCLE, "max_lr": 0.1, "pct_start": 2.0},  # the scheduler's own check, in the partial's call
     "scheduler: torch.optim.lr_scheduler.OneCycleLR refused its settings (Expected float between 0 and 1 pct_start, "
     "but got 2.0; raised at lr_scheduler.py:"),
])
def test_a_schedule_that_does_not_fit_its_keys_or_its_call_is_one_line(node, message):
    """torch's schedulers as `scheduler._target_`: the run calls the partial with (optimizer, total_steps=...,
    steps_per_epoch=...), whose TypeError or ValueError is not wrapped by Hydra."""
    model = torch.nn.Linear(2, 1)
    config = OmegaConf.create({"optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1},
                               "scheduler": node})
    with pytest.raises(UsageError) as error:
        task_and_model.build_optimizers(config, {"model": model}, steps_per_epoch=4, epochs=2)
    assert str(error.value).startswith(message), str(error.value)
    config.scheduler = {**ONE_CYCLE, "max_lr": 0.1}  # what it takes: built
    _, schedulers = task_and_model.build_optimizers(config, {"model": model}, steps_per_epoch=4, epochs=2)
    assert schedulers["model"].total_steps == 8
