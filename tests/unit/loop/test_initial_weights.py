"""A fresh run's initial weights (src/loop/initial_weights.py), in one process. By name: built on the meta
device and materialised, or built whole, every template model starts from the same tensors. By constructor
(dist=ddp's default): the very tensors `torch.manual_seed(seed); Model(...)` gives, as before."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from src.components.models import MLP, LeNet5, SimpleCNN, TinyGPT, TwoInputCNN, resnet18
from src.loop import initial_weights

MODELS = {
    "cnn": lambda: SimpleCNN(in_channels=1, image_size=(8, 8), num_outputs=10),
    "mlp": lambda: MLP(in_features=64, num_outputs=10),
    "lenet": lambda: LeNet5(in_channels=3, num_outputs=10),
    "two_input_cnn": lambda: TwoInputCNN(in_channels=3, num_outputs=2),
    "tiny_gpt": lambda: TinyGPT(vocab_size=40, num_outputs=40, max_length=16),
    "resnet18": lambda: resnet18(in_channels=3, num_outputs=10),
}


def fresh(make, seed: int = 0, on_meta: bool = False) -> nn.Module:  # noqa: ANN001
    """What train.py does on one process: build, allocate what is on meta, initialise."""
    model = initial_weights.build(make, seed, named=True, sharded=on_meta)
    if on_meta:
        model.to_empty(device="cpu")
    initial_weights.initialise(model, seed)
    return model


@pytest.mark.parametrize("name", MODELS)
def test_a_model_built_on_meta_starts_from_the_weights_a_whole_build_gets(name: str):
    on_meta = initial_weights.build(MODELS[name], 0, named=True, sharded=True)
    assert all(tensor.is_meta for tensor in on_meta.state_dict().values())
    whole, materialised = fresh(MODELS[name]).state_dict(), fresh(MODELS[name], on_meta=True).state_dict()
    assert whole.keys() == materialised.keys()
    assert all(torch.equal(whole[key], materialised[key]) for key in whole)
    other_seed = fresh(MODELS[name], seed=1).state_dict()
    weights = [key for key, tensor in whole.items() if tensor.is_floating_point() and tensor.std() > 0]
    assert weights and all(not torch.equal(whole[key], other_seed[key]) for key in weights)


def test_a_module_s_weights_depend_on_its_name_not_on_what_was_built_before_it():
    deep = fresh(lambda: MLP(in_features=64, num_outputs=10, hidden_sizes=(32, 32)))
    shallow = fresh(lambda: MLP(in_features=64, num_outputs=10, hidden_sizes=(32,)))
    assert torch.equal(deep.net[1].weight, shallow.net[1].weight)  # net.1: the first layer in both


def test_the_models_own_init_module_decides_its_distribution():
    gpt = fresh(MODELS["tiny_gpt"])
    assert gpt.head.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert not gpt.head.bias.any() and torch.equal(gpt.norm.weight, torch.ones(64))
    resnet = fresh(MODELS["resnet18"])
    fan_out = resnet.layer1[0].conv1.weight[0].numel() / resnet.layer1[0].conv1.weight.shape[1] * 64
    assert resnet.layer1[0].conv1.weight.std().item() == pytest.approx((2 / fan_out) ** 0.5, rel=0.05)


def test_the_run_s_own_random_state_is_left_as_it_was():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    fresh(MODELS["cnn"])
    assert torch.equal(torch.rand(3), expected)


class _Bare(nn.Module):
    """A module owning a parameter no initialiser covers (no reset_parameters, no init_module)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        self.head = nn.Linear(4, 2)


class _ReadsData(nn.Module):
    """A constructor that reads values out of a tensor (as one reading data would)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(int(torch.tensor(4.0).item()), 2)


class _NamedDevice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(2, device="cpu"))


@pytest.mark.parametrize("make, reason", [
    (_Bare, "the model itself (_Bare) owns tensors but has no reset_parameters(), and _Bare defines no"),
    (_ReadsData, "RuntimeError when built on the meta device (Tensor.item() cannot be called on meta tensors)"),
    (_NamedDevice, "its constructor made table on the cpu device, not on meta"),
], ids=["uncovered module", "reads data", "tensor made on the cpu"])
def test_a_model_that_cannot_be_built_on_meta_is_built_whole_with_one_line(make, reason, caplog):  # noqa: ANN001
    caplog.set_level(logging.INFO)
    model = initial_weights.build(make, 0, named=True, sharded=True)
    assert not any(tensor.is_meta for tensor in model.state_dict().values())
    [line] = [record.getMessage() for record in caplog.records]
    assert line.startswith("dist=fsdp: the model is built whole on every rank, then sharded: ") and reason in line
    initial_weights.initialise(model, 0)
    again = initial_weights.build(make, 0, named=True, sharded=False)
    initial_weights.initialise(again, 0)
    assert all(torch.equal(tensor, again.state_dict()[key]) for key, tensor in model.state_dict().items())


@pytest.mark.parametrize("setting, strategy, named", [
    ("auto", "fsdp", True), ("auto", "ddp", False), ("by_name", "ddp", True), ("constructor", "fsdp", False),
])
def test_auto_initialises_by_name_only_under_fsdp(setting: str, strategy: str, named: bool):
    assert initial_weights.by_name(setting, strategy) is named


@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "fsdp"])
def test_the_constructor_scheme_draws_what_the_constructor_draws_from_the_run_s_random_state(sharded, caplog):  # noqa: ANN001
    """trainer.init_weights=constructor (dist=ddp's default): no RNG of its own, nothing on meta; under dist=fsdp
    (today's path: built whole, then sharded) one line says so."""
    caplog.set_level(logging.INFO)
    torch.manual_seed(3)
    expected, after = MODELS["cnn"]().state_dict(), torch.rand(3)
    torch.manual_seed(3)
    built = initial_weights.build(MODELS["cnn"], 0, named=False, sharded=sharded).state_dict()
    assert built.keys() == expected.keys() and all(torch.equal(built[key], expected[key]) for key in expected)
    assert torch.equal(torch.rand(3), after)  # the run's RNG advanced as the constructor advanced it
    lines = [record.getMessage() for record in caplog.records]
    assert lines == (["dist=fsdp, trainer.init_weights=constructor: the model is built whole on every rank, then "
                      "sharded"] if sharded else [])
