"""Which modules dist=fsdp shards as units (the sharding itself runs in tests/integration/test_fsdp_cli.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from src.common.errors import UsageError
from src.components.models import MLP, SimpleCNN
from src.parallel import fsdp


def test_auto_units_are_the_roots_children_that_hold_parameters():
    model = SimpleCNN(in_channels=1, image_size=(8, 8), num_outputs=10)
    assert fsdp.units(model, []) == [model.features, model.classifier]


def test_auto_units_look_inside_a_lone_container_child():
    model = MLP(in_features=16, num_outputs=3, hidden_sizes=(8, 8))  # everything is in model.net
    assert fsdp.units(model, []) == [layer for layer in model.net if isinstance(layer, nn.Linear)]


def test_auto_units_are_the_members_of_a_module_list_or_dict_which_fully_shard_cannot_take():
    class Blocks(nn.Module):  # a transformer's layout: an embedding, a ModuleList of blocks, a head
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.blocks = nn.ModuleList(nn.ModuleDict({"fc": nn.Linear(8, 8), "proj": nn.Linear(8, 8)})
                                        for _ in range(2))
            self.head = nn.Linear(8, 2)

    model = Blocks()
    assert fsdp.units(model, []) == [model.embed, model.blocks[0]["fc"], model.blocks[0]["proj"],
                                     model.blocks[1]["fc"], model.blocks[1]["proj"], model.head]


def test_auto_units_smaller_than_min_unit_params_stay_with_the_root():
    cnn = SimpleCNN(in_channels=1, image_size=(8, 8), num_outputs=10)
    sizes = [sum(p.numel() for p in child.parameters()) for child in (cnn.features, cnn.classifier)]
    assert sizes == [18_912, 132_490]
    assert fsdp.units(cnn, [], min_unit_params=20_000) == [cnn.classifier]
    assert fsdp.units(cnn, [], min_unit_params=max(sizes) + 1) == []  # the root alone, as with wrap=[root]
    assert fsdp.units(cnn, [], min_unit_params=1_000_000) == []  # the default: the digits CNN has 151k
    wide = MLP(in_features=1024, num_outputs=10, hidden_sizes=(1024, 1024))  # 1.05M, 1.05M and 10k parameters
    assert fsdp.units(wide, [], min_unit_params=1_000_000) == [wide.net[1], wide.net[4]]
    assert fsdp.units(cnn, ["Linear"], min_unit_params=10**9) == [cnn.classifier[2], cnn.classifier[5]]  # by name: all


def test_wrap_names_classes_and_takes_the_outermost_match():
    model = SimpleCNN(in_channels=1, image_size=(8, 8), num_outputs=10)
    assert fsdp.units(model, ["Linear"]) == [model.classifier[2], model.classifier[5]]
    assert fsdp.units(model, ["Sequential", "Linear"]) == [model.features, model.classifier]


def test_a_wrap_that_names_no_class_of_the_model_is_one_error_before_any_sharding():
    model = SimpleCNN(in_channels=1, image_size=(8, 8), num_outputs=10)
    with pytest.raises(UsageError, match=r"dist.fsdp.wrap=\['Block'\] names no module class of the model; its "
                                         r"classes: .*Conv2d.*SimpleCNN"):
        fsdp.shard(model, ["Block"], reshard_after_forward=True, cpu_offload=False, param_dtype=None)


def test_wrap_root_makes_the_whole_model_one_unit():
    model = SimpleCNN(in_channels=1, image_size=(8, 8), num_outputs=10)
    assert fsdp.units(model, ["root"]) == []


class TiedEnds(nn.Module):
    """A GPT's layout: an embedding and a head that share one weight, blocks between."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight


def test_auto_units_leave_modules_that_share_a_tied_weight_to_the_root():
    model = TiedEnds()  # FSDP2 refuses a tied weight in two units, with a traceback at the first forward
    assert fsdp.units(model, []) == list(model.blocks)


def test_a_wrapped_class_whose_weight_is_tied_outside_its_unit_is_one_error():
    expected = (r"^dist.fsdp.wrap=\['Linear'\]: embed.weight is tied across the unit head and the rest of the model; "
                r".* wrap a class holding all its uses, or \[root\]$")
    with pytest.raises(UsageError, match=expected):
        fsdp.units(TiedEnds(), ["Linear"])


def test_to_empty_keeps_a_tied_weight_one_tensor():
    with torch.device("meta"):
        model = TiedEnds()
    fsdp.to_empty(model, "cpu")  # torch's own to_empty gives the head a tensor of its own
    assert model.head.weight is model.embed.weight and not model.embed.weight.is_meta
    assert [name for name, _ in model.named_parameters()] == [
        "embed.weight", "blocks.0.weight", "blocks.0.bias", "blocks.1.weight", "blocks.1.bias"]
