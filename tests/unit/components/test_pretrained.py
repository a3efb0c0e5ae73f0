"""Pretrained backbones (src/components/pretrained.py), offline: timm weights from a local file and torchvision
weights from a file placed in torch's cache load exactly, with a new head of the task's width; the preprocessing
they declare is their weights'; what cannot be fetched, or does not exist, is one line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import timm
import torch
import torchvision
from omegaconf import OmegaConf
from safetensors.torch import save_file

from src.common.errors import UsageError
from src.components import pretrained

IMAGENET = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "image_size": [224, 224]}


def backbone_equal(model: torch.nn.Module, reference: dict[str, torch.Tensor], head: str) -> None:
    """Every tensor of `model` but its head's is the reference's, bit for bit."""
    state = model.state_dict()
    compared = [name for name in state if not name.startswith(head)]
    assert len(compared) == len(reference) - 2  # the head's weight and bias are new
    for name in compared:
        assert torch.equal(state[name], reference[name]), name


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_a_timm_model_starts_from_a_local_weights_file_with_a_new_head(tmp_path: Path, suffix: str, caplog):
    torch.manual_seed(1)
    reference = timm.create_model("resnet18").state_dict()  # 1,000 classes, as a downloaded file would be
    path = tmp_path / f"weights{suffix}"
    save_file(reference, str(path)) if suffix == ".safetensors" else torch.save(reference, path)
    torch.manual_seed(2)  # another seed: nothing but the file decides the backbone
    with caplog.at_level(logging.INFO):
        model = pretrained.timm_model("resnet18", num_outputs=7, pretrained=str(path))
    backbone_equal(model, reference, "fc.")
    assert model.fc.weight.shape == (7, 512)
    assert f"model: timm resnet18 with pretrained weights (file {path}); new head fc " in caplog.text
    config = OmegaConf.create({"name": "resnet18", "pretrained": str(path)})
    assert pretrained.timm_model.preprocessing(config) == IMAGENET
    assert pretrained.timm_model.preprocessing(OmegaConf.create({"name": "resnet18", "pretrained": False})) is None


def test_timm_names_a_missing_file_an_unknown_model_and_a_failed_download_in_one_line(tmp_path: Path, monkeypatch):
    with pytest.raises(UsageError, match=r"^model.pretrained=.*nowhere.pth is not a file: give the path of a weights"):
        pretrained.timm_model("resnet18", 3, pretrained=str(tmp_path / "nowhere.pth"))
    with pytest.raises(UsageError, match=r"^model.name=resnt18 is not a timm model \(close: resnet18"):
        pretrained.timm_model("resnt18", 3)
    import huggingface_hub.constants
    # What a machine without a network gets, at once (the hub reads HF_HUB_OFFLINE into this at import).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UsageError, match=r"^the pretrained weights of timm's resnet18 could not be fetched \(.*\); "
                                         r"without a network, save them as a file and set model.pretrained=PATH$"):
        pretrained.timm_model("resnet18", 3, pretrained=True)


def test_a_timm_segmentation_backbone_loads_its_file_and_upsamples_to_the_input(tmp_path: Path):
    torch.manual_seed(1)
    reference = timm.create_model("resnet18").state_dict()
    save_file(reference, str(tmp_path / "weights.safetensors"))
    model = pretrained.TimmSegmentation("resnet18", 5, pretrained=str(tmp_path / "weights.safetensors"),
                                        feature_index=1)
    for name, tensor in model.backbone.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    assert model(torch.randn(2, 3, 48, 40)).shape == (2, 5, 48, 40)


@pytest.fixture
def torch_home(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    return tmp_path / "torch" / "hub" / "checkpoints"


def test_a_torchvision_model_loads_the_file_placed_in_torch_home_without_a_network(torch_home: Path, caplog):
    torch.manual_seed(1)
    reference = torchvision.models.resnet18().state_dict()
    with pytest.raises(UsageError, match=r"^the weights IMAGENET1K_V1 of torchvision's resnet18 are not in torch's "
                                         r"cache and could not be downloaded \(\w+\); put the file "
                                         rf"resnet18-f37072fd.pth in {torch_home} \(TORCH_HOME="):
        pretrained.torchvision_model("resnet18", 4, weights="IMAGENET1K_V1")
    torch_home.mkdir(parents=True, exist_ok=True)
    torch.save(reference, torch_home / "resnet18-f37072fd.pth")
    torch.manual_seed(2)
    with caplog.at_level(logging.INFO):
        model = pretrained.torchvision_model("resnet18", 4, weights="IMAGENET1K_V1")
    backbone_equal(model, reference, "fc.")
    assert model.fc.out_features == 4
    assert "model: torchvision resnet18 with weights IMAGENET1K_V1" in caplog.text
    assert "new head fc (Linear(" in caplog.text
    config = OmegaConf.create({"name": "resnet18", "weights": "IMAGENET1K_V1"})
    assert pretrained.torchvision_model.preprocessing(config) == IMAGENET


def test_torchvision_names_unknown_weights_models_and_channels_in_one_line():
    with pytest.raises(UsageError, match=r"^model.weights=IMAGENET9 is not a weights of torchvision's resnet18; "
                                         r"choose one of IMAGENET1K_V1, DEFAULT$"):
        pretrained.torchvision_model("resnet18", 4, weights="IMAGENET9")
    with pytest.raises(UsageError, match=r"^model.name=resnet1000 is not a torchvision model; choose one of "):
        pretrained.torchvision_model("resnet1000", 4)
    with pytest.raises(UsageError) as error:  # what to do for digits and MNIST, which have no dataset.channels
        pretrained.torchvision_model("resnet18", 4, in_channels=1)
    assert str(error.value) == ("model=torchvision takes 3-channel images, and the dataset gives 1: set "
                                "dataset.channels=3 where the dataset has it (image_folder, arrow: greyscale repeated "
                                "into RGB), or use model=timm, whose first convolution takes 1")


def test_a_torchvision_segmentation_model_gets_new_heads_and_returns_its_dict(torch_home: Path):
    torch.manual_seed(1)
    reference = torchvision.models.get_model("fcn_resnet50", num_classes=21, aux_loss=True,
                                             weights_backbone=None).state_dict()
    torch_home.mkdir(parents=True)
    name = Path(torchvision.models.get_model_weights("fcn_resnet50")["COCO_WITH_VOC_LABELS_V1"].url).name
    torch.save(reference, torch_home / name)
    model = pretrained.torchvision_model("fcn_resnet50", 3, weights="COCO_WITH_VOC_LABELS_V1")
    assert model.classifier[4].out_channels == 3 and model.aux_classifier[4].out_channels == 3
    out = model.eval()(torch.randn(1, 3, 64, 64))
    assert out["out"].shape == (1, 3, 64, 64)
    assert torch.equal(model.backbone.conv1.weight, reference["backbone.conv1.weight"])


def test_timm_s_own_init_weights_is_not_the_template_s_init_hook():
    """ResNet's init_weights would re-initialise the pretrained weights, or be called on the meta device."""
    from src.loop import initial_weights

    built = initial_weights.build(lambda: pretrained.timm_model("resnet18", 3), "model", seed=0, sharded=False)
    assert built.hook is None and not any(tensor.is_meta for tensor in built.model.parameters())
