"""Models take their shapes from what the dataset provides, named in their YAML as ${data:FIELD}."""

import re

import pytest
import torch
from conftest import REPO
from omegaconf import OmegaConf

from src.common.errors import UsageError, find_usage_error
from src.components.models import MLP, LeNet5, SimpleCNN, TinyGPT, TwoInputCNN, resnet18
from src.config import building, data_fields
from src.loop.task_and_model import build_model


def image_fields(channels: int, size: tuple[int, int], outputs: int = 7) -> dict:
    return {"in_channels": channels, "image_size": list(size), "num_features": channels * size[0] * size[1],
            "num_classes": outputs, "num_outputs": outputs}


def from_yaml(name: str, fields: dict) -> torch.nn.Module:
    """`conf/model/<name>.yaml` built the way train.py builds it, with `fields` as the dataset's."""
    config = OmegaConf.create({"model": OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml")})
    return build_model(data_fields.fill(config.model, fields, "dataset=test"))


@pytest.fixture(autouse=True)
def resolver():
    data_fields.register_resolver()


@pytest.mark.parametrize("channels,size", [(1, (8, 8)), (1, (28, 28)), (3, (32, 32))])
@pytest.mark.parametrize("name", ["cnn", "mlp", "resnet18"])
def test_image_models_fit_any_dataset_shape(name, channels, size):
    model = from_yaml(name, image_fields(channels, size))
    out = model(torch.randn(4, channels, *size))
    assert out.shape == (4, 7)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_feature_models_take_vectors_and_the_tasks_output_width():
    fields = {"num_features": 30, "num_classes": 2, "num_outputs": 1}
    for name in ("linear", "mlp"):
        model = from_yaml(name, fields)
        assert model(torch.randn(5, 30)).shape == (5, 1), name
    linear = from_yaml("linear", fields)
    assert [type(m).__name__ for m in linear.net] == ["Flatten", "Linear"] and linear.net[1].bias is not None
    assert from_yaml("linear", image_fields(1, (8, 8), outputs=10))(torch.randn(5, 1, 8, 8)).shape == (5, 10)


def test_a_field_the_dataset_lacks_is_one_line_naming_both_sides():
    with pytest.raises(Exception) as raised:
        from_yaml("cnn", {"num_features": 10, "num_targets": 1, "num_outputs": 1})
    message = str(find_usage_error(raised.value))
    assert message.startswith("model.in_channels asks for the dataset's in_channels, which dataset=test does not "
                              "provide (it provides num_features=10, num_targets=1, num_outputs=1)")


@pytest.mark.parametrize("name, key, value, shown", [
    ("mlp", "hidden_sizes", [0], "hidden_sizes=[0]"), ("mlp", "hidden_sizes", [16, -1], "hidden_sizes=[16, -1]"),
    ("cnn", "channels", [8, 0], "channels=[8, 0]"), ("cnn", "hidden", 0, "hidden=0"),
])
def test_a_layer_narrower_than_one_is_refused_in_one_line(name, key, value, shown):
    """torch builds a zero-width layer with a warning only (the model's output is then a constant), and fails deep
    inside on a negative one: the model refuses both, and building it says so in one line naming the keys."""
    config = OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml")
    config[key] = value
    filled = data_fields.fill(config, image_fields(1, (8, 8)), "dataset=test")
    with pytest.raises(UsageError) as raised, building.errors_named("model", filled):  # as train.py builds it
        build_model(filled)
    target = {"mlp": "MLP", "cnn": "SimpleCNN"}[name]
    assert re.fullmatch(rf"model: src\.components\.models\.{target} refused its settings \({re.escape(shown)}: every "
                        r"layer needs a width of at least 1; raised at models\.py:\d+\): change the model\.\* keys",
                        str(raised.value)), str(raised.value)


def test_the_other_models_refuse_a_zero_width_and_an_mlp_without_hidden_layers_is_linear():
    for build, shown in ((lambda: TwoInputCNN(3, 2, channels=(4, 0)), "channels=[4, 0]"),
                         (lambda: TinyGPT(10, 10, 8, width=0), "width=0")):
        with pytest.raises(ValueError) as raised:
            build()
        assert str(raised.value) == f"{shown}: every layer needs a width of at least 1"
    linear = MLP(30, 1, hidden_sizes=[])
    assert [type(m).__name__ for m in linear.net] == ["Flatten", "Linear"]


def test_an_override_replaces_the_field():
    config = OmegaConf.load(REPO / "conf" / "model" / "mlp.yaml")
    config.num_outputs = 4
    filled = data_fields.fill(config, {"num_features": 64, "num_outputs": 10}, "dataset=test")
    assert build_model(filled)(torch.randn(2, 64)).shape == (2, 4)


def test_cnn_has_batchnorm_and_the_classic_shape():
    model = SimpleCNN(in_channels=1, image_size=(8, 8), num_outputs=10)
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) == 2
    assert model.classifier[2].in_features == 64 * 4 * 4
    assert sum(p.numel() for p in model.parameters()) == 288 + 18432 + 2 * 96 + 1024 * 128 + 128 + 1290
    assert sum(p.numel() for p in MLP(in_features=64, num_outputs=10).parameters()) == 64 * 256 + 256 * 256 + 2570 + 512


def test_resnet18_small_image_stem():
    model = resnet18(in_channels=1, num_outputs=10)
    assert model.conv1.stride == (1, 1) and model.conv1.in_channels == 1
    assert isinstance(model.maxpool, torch.nn.Identity)
    large = resnet18(in_channels=1, num_outputs=10, small_images=False)
    assert large.conv1.stride == (2, 2) and large.conv1.in_channels == 1


def test_two_input_cnn_averages_image_features_over_the_mask():
    torch.manual_seed(0)
    model = TwoInputCNN(in_channels=3, num_outputs=2).eval()
    rgb = torch.randn(2, 3, 8, 8)
    left, right = torch.zeros(2, 1, 8, 8), torch.zeros(2, 1, 8, 8)
    left[..., :4], right[..., 4:] = 1, 1
    assert model(rgb, left).shape == (2, 2)
    assert not torch.allclose(model(rgb, left), model(rgb, right))  # the mask matters
    changed = rgb.clone()
    changed[..., 6:] += 5  # far from the left half (two 3x3 convs see 2 pixels across)
    assert torch.allclose(model(rgb, left), model(changed, left), atol=1e-6)  # only masked pixels count
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) == 2


def test_lenet5_is_the_classic_layout_for_32x32_rgb():
    model = from_yaml("lenet", image_fields(3, (32, 32), outputs=10))
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [(c.in_channels, c.out_channels, c.kernel_size) for c in convs] == [(3, 6, (5, 5)), (6, 16, (5, 5))]
    assert [(f.in_features, f.out_features) for f in linears] == [(16 * 5 * 5, 120), (120, 84), (84, 10)]
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert from_yaml("lenet", image_fields(1, (16, 16), outputs=10))(torch.randn(2, 1, 16, 16)).shape == (2, 10)
    with pytest.raises(ValueError, match=r"^LeNet5 takes images of at least 16x16 .*, not 8x8: choose a dataset"):
        LeNet5(in_channels=1, num_outputs=10, image_size=(8, 8))  # digits: one line, not a failing forward


def tiny_gpt() -> torch.nn.Module:
    return from_yaml("tiny_gpt", {"vocab_size": 256, "num_outputs": 256, "max_length": 16}).eval()


def test_tiny_gpt_is_causal_so_padding_never_changes_the_tokens_before_it():
    model = tiny_gpt()
    tokens = torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    padded = tokens.clone()
    padded[:, 9:] = 0  # a shorter document, padded at the end
    with torch.no_grad():
        logits, logits_padded = model(tokens), model(padded)
    assert logits.shape == (2, 16, 256)
    assert torch.allclose(logits[:, :9], logits_padded[:, :9], atol=1e-6)  # position t sees positions <= t
    assert not torch.allclose(logits[:, 9:], logits_padded[:, 9:], atol=1e-3)


def test_tiny_gpt_attends_through_scaled_dot_product_attention(monkeypatch):
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *args, **kwargs: calls.append(kwargs["is_causal"]) or original(*args, **kwargs))
    tiny_gpt()(torch.zeros(1, 4, dtype=torch.int64))
    assert calls == [True, True]  # one causal attention per block (depth 2)
