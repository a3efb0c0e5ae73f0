"""A fresh run's initial weights (src/loop/initial_weights.py), in one process: the model's own code decides them.
A model with a hook (`init_module(module, name)`, `init_weights()`) is built on the meta device and initialised by
it, to the same tensors as when built whole; a model without one gets the very tensors `Model(...)` draws from the
run's RNG. Several ranks and both strategies: tests/integration/test_initial_weights_cli.py."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

from src.common.errors import UsageError
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


def fresh(make, seed: int = 0, name: str = "model") -> nn.Module:  # noqa: ANN001
    """What train.py does on one process: build, allocate what is on meta, initialise."""
    initial = initial_weights.build(make, name, seed, sharded=False)
    model = initial.model
    if any(tensor.is_meta for tensor in model.state_dict().values()):
        model.to_empty(device="cpu")
    initial_weights.initialise(initial, model, seed)
    return model


def built_whole(monkeypatch, make, seed: int = 0) -> nn.Module:  # noqa: ANN001
    """The same model, as a model that cannot be built on the meta device gets it: built whole, then its hook."""
    with monkeypatch.context() as patched:
        patched.setattr(initial_weights, "_built_on_meta", lambda make: (None, "it cannot here"))
        return fresh(make, seed)


@pytest.mark.parametrize("name", MODELS)
def test_every_built_in_model_is_built_on_meta_and_starts_from_the_weights_a_whole_build_gets(name: str,
                                                                                              monkeypatch):
    initial = initial_weights.build(MODELS[name], "model", 0, sharded=True)
    assert initial.hook == "init_module" and all(tensor.is_meta for tensor in initial.model.state_dict().values())
    materialised, whole = fresh(MODELS[name]).state_dict(), built_whole(monkeypatch, MODELS[name]).state_dict()
    assert whole.keys() == materialised.keys()
    assert all(torch.equal(whole[key], materialised[key]) for key in whole)
    other_seed = fresh(MODELS[name], seed=1).state_dict()
    weights = [key for key, tensor in whole.items() if tensor.is_floating_point() and tensor.std() > 0]
    assert weights and all(not torch.equal(whole[key], other_seed[key]) for key in weights)


@pytest.mark.parametrize("name", ["cnn", "mlp", "lenet", "two_input_cnn"])
def test_torch_s_layer_defaults_give_the_constructor_s_very_weights_built_on_meta(name: str):
    """LayerDefaults replays the constructor's draws in its order: a run of the model named `model` starts where
    `torch.manual_seed(seed); Model(...)` does, as every run did before the hook."""
    torch.manual_seed(4)
    constructed = MODELS[name]().state_dict()
    materialised = fresh(MODELS[name], seed=4).state_dict()
    assert all(torch.equal(constructed[key], materialised[key]) for key in constructed)
    other_model = fresh(MODELS[name], seed=4, name="generator").state_dict()  # each of a run's models draws apart
    weights = [key for key, tensor in constructed.items() if tensor.is_floating_point() and tensor.std() > 0]
    assert all(not torch.equal(constructed[key], other_model[key]) for key in weights)


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


# -- models that declare no hook: the constructor's weights -------------------------------------------------------


class ZeroHead(nn.Module):
    """A constructor that zero-initialises its head: what by-name re-drawing used to undo."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)


class NanoStyle(nn.Module):
    """nanoGPT's way: `self.apply(self._init_weights)` in the constructor, then a per-name rule on `c_proj`."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"c_fc": nn.Linear(8, 32), "c_proj": nn.Linear(32, 8)})
                                    for _ in range(layers))
        self.apply(self._init_weights)
        for name, parameter in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)


def plain_layers() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


@pytest.mark.parametrize("make", [ZeroHead, NanoStyle, plain_layers], ids=["zero head", "self.apply", "layers"])
@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "fsdp"])
def test_a_model_without_a_hook_gets_what_its_constructor_draws_from_the_run_s_random_state(make, sharded, caplog):
    caplog.set_level(logging.INFO)
    torch.manual_seed(3)
    expected, after = make().state_dict(), torch.rand(3)
    torch.manual_seed(3)
    initial = initial_weights.build(make, "model", 0, sharded=sharded)
    built = initial.model.state_dict()
    assert initial.hook is None and built.keys() == expected.keys()
    assert all(torch.equal(built[key], expected[key]) for key in expected)
    assert torch.equal(torch.rand(3), after)  # the run's RNG advanced as the constructor advanced it
    if make is ZeroHead:
        assert built["head.weight"].abs().sum() == 0 and built["head.bias"].abs().sum() == 0
    lines = [record.getMessage() for record in caplog.records]
    name = type(initial.model).__name__
    assert lines == ([f"dist=fsdp: the model ({name}) is built whole on every rank, then sharded: it declares no "
                      "init_module(module, name) or init_weights(); give it one to build it on the meta device, "
                      "each rank allocating only its shards"] if sharded else [])


# -- hooks ------------------------------------------------------------------------------------------------------


class PerName(nn.Module):
    """init_module with a per-name rule: the `c_proj` layers' weights scaled by 1/sqrt(2 layers)."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.layers = layers
        self.blocks = nn.ModuleList(nn.ModuleDict({"c_fc": nn.Linear(8, 64), "c_proj": nn.Linear(64, 64)})
                                    for _ in range(layers))

    def init_module(self, module: nn.Module, name: str) -> None:
        std = 0.02 / math.sqrt(2 * self.layers) if name.endswith("c_proj") else 0.02
        nn.init.normal_(module.weight, std=std)
        nn.init.zeros_(module.bias)


class WholeModel(nn.Module):
    """torchtitan's way: one init_weights() for the whole model (a zero head here)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def init_weights(self) -> None:
        nn.init.trunc_normal_(self.body.weight, std=0.02)
        nn.init.zeros_(self.body.bias)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)


def test_a_per_name_rule_in_init_module_holds_on_meta_and_whole(monkeypatch):
    model = fresh(PerName)
    assert model.blocks[0].c_proj.weight.std().item() == pytest.approx(0.01, rel=0.1)
    assert model.blocks[1].c_fc.weight.std().item() == pytest.approx(0.02, rel=0.1)
    whole = built_whole(monkeypatch, PerName).state_dict()
    assert all(torch.equal(tensor, whole[key]) for key, tensor in model.state_dict().items())


def test_a_model_level_init_weights_is_built_on_meta_and_called_on_a_whole_copy(monkeypatch):
    initial = initial_weights.build(WholeModel, "model", 0, sharded=True)
    assert initial.hook == "init_weights" and initial.model.head.weight.is_meta
    model = fresh(WholeModel)
    assert model.head.weight.abs().sum() == 0 and model.body.weight.std().item() == pytest.approx(0.02, rel=0.2)
    whole = built_whole(monkeypatch, WholeModel).state_dict()
    assert all(torch.equal(tensor, whole[key]) for key, tensor in model.state_dict().items())


class Forgetful(nn.Module):
    """init_module that covers Linear layers but not the LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def init_module(self, module: nn.Module, name: str) -> None:
        if isinstance(module, nn.Linear):
            module.reset_parameters()


def test_a_hook_that_leaves_a_tensor_unset_is_one_line():
    with pytest.raises(UsageError) as error:
        fresh(Forgetful)
    assert str(error.value) == ("Forgetful.init_module left norm.weight unset: the model is built on the meta device, "
                                "where its constructor's values do not exist; set it there (e.g. "
                                "module.reset_parameters()), or remove the hook to build the model by its constructor")


class _ReadsData(nn.Module):
    """A constructor that reads values out of a tensor (as one reading data would)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(int(torch.tensor(4.0).item()), 2)

    def init_module(self, module: nn.Module, name: str) -> None:
        module.reset_parameters()


class _NamedDevice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(2, device="cpu"))

    def init_weights(self) -> None:
        nn.init.ones_(self.table)


@pytest.mark.parametrize("make, reason", [
    (_ReadsData, "RuntimeError when built on the meta device (Tensor.item() cannot be called on meta tensors)"),
    (_NamedDevice, "its constructor made table on the cpu device, not on meta"),
], ids=["reads data", "tensor made on the cpu"])
def test_a_model_with_a_hook_that_cannot_be_built_on_meta_is_built_whole_and_initialised_by_it(make, reason, caplog):
    caplog.set_level(logging.INFO)
    initial = initial_weights.build(make, "model", 0, sharded=True)
    assert not any(tensor.is_meta for tensor in initial.model.state_dict().values()) and initial.hook is None
    [line] = [record.getMessage() for record in caplog.records]
    assert line.startswith("the model is built whole on every rank, then initialised by its ") and reason in line
    again = fresh(make)
    assert all(torch.equal(tensor, again.state_dict()[key]) for key, tensor in initial.model.state_dict().items())
