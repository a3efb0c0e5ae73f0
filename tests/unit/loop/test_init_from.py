"""src/loop/init_from.py: a fresh run starts from a file's model weights (a checkpoint of this template, a
plain state_dict, a .safetensors file), keys matched without wrapper prefixes, every mismatch named; and
trainer.freeze takes parameters out of training."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from src.checkpoint.store import FORMAT
from src.common.errors import UsageError
from src.loop import init_from
from src.loop.init_from import match, strip_prefixes

HAS_SAFETENSORS = importlib.util.find_spec("safetensors") is not None


class Net(nn.Module):
    """A backbone (with BatchNorm buffers) and a head whose width is the class count."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU())
        self.head = nn.Linear(5, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def trained_net(classes: int = 10) -> Net:
    torch.manual_seed(1)
    net = Net(classes)
    net(torch.randn(8, 6))  # moves the BatchNorm running statistics off their initial values
    return net


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The weights init_from reads from `path` for a run of one model."""
    return init_from.read_weights(path, ["model"], "model")["model"]


def load_initial_weights(module: nn.Module, path: Path, strict: bool) -> init_from.Match:
    return init_from.load_initial_weights({"model": module}, "model", path, strict)["model"]


def load_on_every_rank(module: nn.Module, path: Path, strict: bool) -> None:
    init_from.load_on_every_rank({"model": module}, "model", path, strict)


def freeze(module: nn.Module, prefixes: list[str]) -> int:
    return init_from.freeze({"model": module}, prefixes)


def save(tmp_path: Path, payload, name: str = "weights.pt") -> Path:
    path = tmp_path / name
    torch.save(payload, path)
    return path


def test_a_checkpoint_of_this_template_gives_its_model_weights_only(tmp_path: Path):
    source = trained_net()
    path = save(tmp_path, {"format": FORMAT, "optimizers": {"model": {}}, "loop": {"step": 7},
                           "models": {"model": source.state_dict()}})
    weights = read_weights(path)
    assert set(weights) == set(source.state_dict())
    torch.manual_seed(2)
    target = Net()
    load_initial_weights(target, path, strict=True)
    for key, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], tensor), key


def test_wrapper_prefixes_are_stripped(tmp_path: Path):
    state = {f"module._orig_mod.{key}": value for key, value in trained_net().state_dict().items()}
    assert set(strip_prefixes(state)) == set(Net().state_dict())
    path = save(tmp_path, state)
    assert match(Net(), read_weights(path)).problems == ""


def test_another_head_is_refused_when_strict_and_reinitialised_when_not(tmp_path: Path, caplog):
    source = trained_net(classes=10)
    path = save(tmp_path, source.state_dict())
    torch.manual_seed(3)
    target = Net(classes=4)
    fresh_head = {key: value.clone() for key, value in target.head.state_dict().items()}
    refused = (r"does not fit the model \(2 shape differs: head.weight file\[10, 5\] model\[4, 5\], "
               r"head.bias file\[10\] model\[4\]\); pass init_from_strict=false")
    with pytest.raises(UsageError, match=refused):
        load_initial_weights(target, path, strict=True)
    assert torch.equal(target.head.weight, fresh_head["weight"])  # nothing loaded
    with caplog.at_level(logging.INFO, logger="src.loop.init_from"):
        found = load_initial_weights(target, path, strict=False)
    assert found.mismatched == ["head.weight file[10, 5] model[4, 5]", "head.bias file[10] model[4]"]
    for key, value in target.features.state_dict().items():  # the backbone: the source's, bitwise
        assert torch.equal(value, source.features.state_dict()[key]), key
    for key, value in target.head.state_dict().items():  # the head: its fresh initialisation
        assert torch.equal(value, fresh_head[key]), key
    lines = [record.getMessage() for record in caplog.records]
    assert f"init_from: loaded 7 of the model's 9 tensors from {path}" in lines
    assert "init_from: 2 shape differs (fresh initialisation kept): head.weight file[10, 5] model[4, 5], " \
           "head.bias file[10] model[4]" in lines


def test_missing_and_unexpected_keys_are_one_line_each(tmp_path: Path, caplog):
    state = trained_net().state_dict()
    state.pop("head.bias")
    state.pop("features.1.running_var")
    state["extra.weight"] = torch.zeros(2)
    state["old_head.weight"] = torch.zeros(2)
    path = save(tmp_path, state)
    with pytest.raises(UsageError, match="2 missing: features.1.running_var, head.bias; 2 unexpected: "
                                         "extra.weight, old_head.weight"):
        load_initial_weights(Net(), path, strict=True)
    with caplog.at_level(logging.INFO, logger="src.loop.init_from"):
        load_initial_weights(Net(), path, strict=False)
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warnings == [
        "init_from: 2 missing from the file (fresh initialisation kept): features.1.running_var, head.bias",
        "init_from: 2 unexpected in the file (ignored): extra.weight, old_head.weight",
    ]


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    (b"", "is it a complete .pt file saved with torch.save?"),
    ("truncated", "cannot be read ("),
    ({"foo": torch.zeros(3)}, "none of its 1 keys matches a weight of the model (foo); the model expects e.g. "
                              "features.0.weight, features.0.bias, features.1.weight, features.1.bias and 5 more"),
    ({"lr": 0.1}, "holds no state_dict"),
    ([torch.zeros(2)], "holds no state_dict"),
])
def test_files_that_give_no_weights_are_one_line(tmp_path: Path, content, message):
    path = tmp_path / "weights.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content == "truncated":
        torch.save(trained_net().state_dict(), path)
        path.write_bytes(path.read_bytes()[:200])
    elif content is not None:
        torch.save(content, path)
    for strict in (True, False):
        with pytest.raises(UsageError) as error:
            load_on_every_rank(Net(), path, strict)  # one process: no group to agree with
        assert str(error.value).startswith(f"init_from={path}") and message in str(error.value)
        assert "\n" not in str(error.value)


def test_a_file_that_would_run_code_is_refused(tmp_path: Path):
    path = save(tmp_path, {"weight": torch.zeros(2), "hook": Net})  # a class: weights_only refuses it
    with pytest.raises(UsageError, match="cannot be read"):
        read_weights(path)


@pytest.mark.skipif(not HAS_SAFETENSORS, reason="the safetensors package is not installed")
def test_a_safetensors_file_loads(tmp_path: Path):
    from safetensors.torch import save_file

    source = trained_net()
    path = tmp_path / "weights.safetensors"
    save_file({f"module.{key}": value.contiguous() for key, value in source.state_dict().items()}, str(path))
    target = Net()
    load_initial_weights(target, path, strict=True)
    assert torch.equal(target.head.weight, source.head.weight)


@pytest.mark.skipif(HAS_SAFETENSORS, reason="the safetensors package is installed")
def test_a_safetensors_file_without_the_package_is_one_line(tmp_path: Path):
    path = tmp_path / "weights.safetensors"
    path.write_bytes(b"not read")
    with pytest.raises(UsageError, match="is a safetensors file: install the safetensors package"):
        read_weights(path)


def test_freeze_takes_the_prefixed_parameters_out_of_training():
    net = Net()
    frozen = freeze(net, ["features"])
    assert frozen == 6 * 5 + 5 + 5 + 5  # Linear(6, 5) and BatchNorm1d(5)'s weight and bias
    assert [name for name, p in net.named_parameters() if p.requires_grad] == ["head.weight", "head.bias"]
    assert freeze(Net(), []) == 0


def test_a_prefix_matching_nothing_or_freezing_everything_is_one_line():
    with pytest.raises(UsageError, match="trainer.freeze: no parameter name starts with backbone; the model's "
                                         "parameter names start with features, head"):
        freeze(Net(), ["features", "backbone"])
    with pytest.raises(UsageError, match="freezes every parameter of the model: nothing would train"):
        freeze(Net(), ["features", "head"])
