"""Pretrained backbones as model options: any timm architecture (`model=timm`), any torchvision model with its
weights enum (`model=torchvision`), and a timm backbone with a small segmentation head (`model=timm_segmentation`).

Each is built with a new head of the task's width (named in the log), and says which input its weights were trained
on (`preprocessing`: mean, std, image size), which the image datasets follow through `${weights:FIELD,DEFAULT}`
(src/config/data_fields.py) unless their config sets the value. A model rebuilt from a checkpoint (eval.py, aux
models, `load_trained`) is built without `pretrained`/`weights`: the checkpoint's weights replace them. This module
imports timm at its top, so only runs that use these models import it.
"""

from __future__ import annotations

import difflib
import logging
from pathlib import Path
from typing import Any

import timm
import torch
import torch.nn.functional as F
from torch import nn
from torchvision import models as tv_models

from src.common.errors import UsageError

log = logging.getLogger(__name__)


def _on_meta() -> bool:
    """Built on the meta device (the loop's look for an init hook, src/loop/initial_weights.py): no weights to load
    into it, nothing to log; the model is then built for real."""
    return torch.get_default_device().type == "meta"


# -- timm ---------------------------------------------------------------------------------------------------------


def timm_model(name: str, num_outputs: int, in_channels: int = 3, pretrained: bool | str = False,
               drop_rate: float = 0.0, drop_path_rate: float | None = None) -> nn.Module:
    """timm's `name` (e.g. `convnext_tiny`, `resnet50.a1_in1k`) with a new classifier of `num_outputs`;
    `pretrained`: false (random), true (timm's download and cache) or the path of a weights file (.safetensors or
    .pth) for a machine without a network. The input convolution takes `in_channels` (timm adapts pretrained RGB
    weights to other counts)."""
    model = _create(name, pretrained, num_classes=num_outputs, in_chans=in_channels, drop_rate=drop_rate,
                    **({} if drop_path_rate is None else {"drop_path_rate": drop_path_rate}))
    if pretrained and not _on_meta():
        log.info("model: timm %s with pretrained weights (%s); new head %s (%s)", name, _source(pretrained),
                 model.default_cfg.get("classifier"), model.get_classifier())
    return model


def _create(name: str, pretrained: bool | str, **kwargs: Any) -> nn.Module:
    """timm.create_model, its weights from `pretrained` (see `timm_model`); a weights file that is missing, or a
    download that fails, is one line."""
    overlay = None
    pretrained = False if _on_meta() else pretrained
    if isinstance(pretrained, str):
        if not Path(pretrained).is_file():
            raise UsageError(f"model.pretrained={pretrained} is not a file: give the path of a weights file "
                             "(.safetensors or .pth), or model.pretrained=true to download them")
        overlay = {"file": str(Path(pretrained).resolve())}
    try:
        model = timm.create_model(name, pretrained=bool(pretrained), pretrained_cfg_overlay=overlay, **kwargs)
        # timm's own init_weights (ResNet's, ...) is not this template's init hook (src/loop/initial_weights.py):
        # the model keeps what its constructor and `pretrained` gave it.
        model.init_weights = None
        return model
    except RuntimeError as error:
        if "Unknown model" in str(error):
            close = ", ".join(difflib.get_close_matches(name, timm.list_models(), n=3))
            raise UsageError(f"model.name={name} is not a timm model{f' (close: {close})' if close else ''}; "
                             "timm.list_models() lists them all") from None
        raise
    except (OSError, ValueError) as error:  # no network, no such weights
        if overlay is not None or not pretrained:
            raise
        reason = " ".join(str(error).split())[:160]
        raise UsageError(f"the pretrained weights of timm's {name} could not be fetched ({type(error).__name__}: "
                         f"{reason}); without a network, save them as a file and set model.pretrained=PATH") from None


def _source(pretrained: bool | str) -> str:
    return f"file {pretrained}" if isinstance(pretrained, str) else "timm's cache"


def _timm_preprocessing(cfg: Any) -> dict[str, Any] | None:
    """The input the pretrained weights of `cfg.name` were trained on (None without pretrained weights)."""
    if not cfg.get("pretrained"):
        return None
    pretrained_cfg = timm.get_pretrained_cfg(str(cfg.name))
    if pretrained_cfg is None:
        return None
    return {"mean": list(pretrained_cfg.mean), "std": list(pretrained_cfg.std),
            "image_size": list(pretrained_cfg.input_size[1:])}


timm_model.preprocessing = _timm_preprocessing  # type: ignore[attr-defined]


class TimmSegmentation(nn.Module):
    """A timm backbone's feature map number `feature_index` (features_only; -1: the deepest), a small head (3x3 conv,
    BatchNorm, ReLU, 1x1 conv to `num_outputs` classes) and a bilinear upsampling to the input's size: logits
    (N, C, H, W)."""

    def __init__(self, name: str, num_outputs: int, in_channels: int = 3, pretrained: bool | str = False,
                 head_width: int = 128, feature_index: int = -1) -> None:
        super().__init__()
        self.backbone = _create(name, pretrained, features_only=True, out_indices=(feature_index,),
                                in_chans=in_channels)
        width = self.backbone.feature_info.channels()[-1]
        self.head = nn.Sequential(nn.Conv2d(width, head_width, 3, padding=1, bias=False),  # no bias before BN
                                  nn.BatchNorm2d(head_width), nn.ReLU(inplace=True),
                                  nn.Conv2d(head_width, num_outputs, 1))
        if pretrained and not _on_meta():
            log.info("model: timm %s backbone with pretrained weights (%s); new head %s", name, _source(pretrained),
                     "head (3x3 conv, BatchNorm, ReLU, 1x1 conv)")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.backbone(images)[-1]
        return F.interpolate(self.head(features), size=images.shape[-2:], mode="bilinear", align_corners=False)

    preprocessing = staticmethod(_timm_preprocessing)


# -- torchvision -----------------------------------------------------------------------------------------------


def torchvision_model(name: str, num_outputs: int, weights: str | None = None, in_channels: int = 3,
                      **kwargs: Any) -> nn.Module:
    """`torchvision.models.get_model(name)`, with `weights` (a member of its weights enum, e.g. IMAGENET1K_V2;
    null: random) read from torch's cache ($TORCH_HOME/hub/checkpoints), downloaded there if missing; its
    classification or segmentation head (every final layer of the weights' class count, an auxiliary one too)
    replaced by one of `num_outputs`. Segmentation models return their dict ({"out": logits, ...})."""
    if in_channels != 3:
        raise UsageError(f"model=torchvision takes 3-channel images, and the dataset gives {in_channels}: set "
                         "dataset.channels=3 where the dataset has it (image_folder, arrow: greyscale repeated into "
                         f"RGB), or use model=timm, whose first convolution takes {in_channels}")
    if weights is None or _on_meta():
        return _torchvision(name, num_classes=num_outputs, **kwargs)
    member = _weights(name, weights)
    _fetch(member, name, weights)
    model = _torchvision(name, weights=member, **kwargs)
    replaced = _replace_heads(model, len(member.meta["categories"]), num_outputs)
    log.info("model: torchvision %s with weights %s (%s); new head %s", name, weights, _cached(member),
             ", ".join(replaced))
    return model


def _torchvision(name: str, **kwargs: Any) -> nn.Module:
    try:
        return tv_models.get_model(name, **kwargs)
    except ValueError as error:
        if "Unknown model" not in str(error) and "not found" not in str(error):
            raise
        raise UsageError(f"model.name={name} is not a torchvision model; choose one of "
                         f"{', '.join(tv_models.list_models()[:12])}, ... (torchvision.models.list_models())") from None


def _weights(name: str, weights: str) -> Any:
    """The member `weights` of model `name`'s weights enum, or one line listing its members."""
    try:
        enum = tv_models.get_model_weights(name)
    except (ValueError, KeyError):
        _torchvision(name)  # the model's own error, if it is none
        raise UsageError(f"torchvision's {name} has no pretrained weights: set model.weights=null") from None
    if weights not in enum.__members__:
        raise UsageError(f"model.weights={weights} is not a weights of torchvision's {name}; choose one of "
                         f"{', '.join(enum.__members__)}")
    return enum[weights]


def _cached(member: Any) -> Path:
    """Where torch keeps (and looks first for) the file of weights `member`."""
    return Path(torch.hub.get_dir()) / "checkpoints" / Path(member.url).name


def _fetch(member: Any, name: str, weights: str) -> None:
    """Download the weights file into torch's cache if it is not there yet; a failed download is one line saying
    which file to put where."""
    if _cached(member).is_file():
        return
    try:
        member.get_state_dict(progress=False, check_hash=True)
    except Exception as error:  # noqa: BLE001 - no network, a proxy, a full disk: the same remedy
        raise UsageError(f"the weights {weights} of torchvision's {name} are not in torch's cache and could not be "
                         f"downloaded ({type(error).__name__}); put the file {_cached(member).name} in "
                         f"{_cached(member).parent} (TORCH_HOME={Path(torch.hub.get_dir()).parent})") from None


def _replace_heads(model: nn.Module, classes: int, num_outputs: int) -> list[str]:
    """Replace every last layer that outputs the weights' `classes` (a Linear, or a 1x1 Conv2d of a segmentation
    head) with a new one of `num_outputs`; returns their names."""
    replaced = []
    for name, layer in list(model.named_modules()):
        fresh: nn.Module | None = None
        if isinstance(layer, nn.Linear) and layer.out_features == classes:
            fresh = nn.Linear(layer.in_features, num_outputs, bias=layer.bias is not None)
        elif isinstance(layer, nn.Conv2d) and layer.out_channels == classes and layer.kernel_size == (1, 1):
            fresh = nn.Conv2d(layer.in_channels, num_outputs, 1, bias=layer.bias is not None)
        if fresh is not None:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, fresh)
            replaced.append(f"{name} ({fresh})")
    if not replaced:
        raise UsageError(f"found no final layer of {classes} outputs to replace with one of the task's {num_outputs}")
    return replaced


def _torchvision_preprocessing(cfg: Any) -> dict[str, Any] | None:
    """The input the weights `cfg.weights` of `cfg.name` were trained on (None without weights)."""
    if not cfg.get("weights"):
        return None
    transform = _weights(str(cfg.name), str(cfg.weights)).transforms()
    size = getattr(transform, "crop_size", None) or transform.resize_size
    return {"mean": list(transform.mean), "std": list(transform.std), "image_size": [size[0], size[-1]]}


torchvision_model.preprocessing = _torchvision_preprocessing  # type: ignore[attr-defined]
