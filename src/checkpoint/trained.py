"""A trained model in one call, from any checkpoint of train.py:

    from src.checkpoint.trained import load_trained
    model, config = load_trained("outputs/DATE/TIME/checkpoints/best.pt")   # or a sharded step_<N>/, last, best
    model, config = load_trained(path, weights="ema")                         # its EMA weights
    model, _ = load_trained(path, model="discriminator")                      # another model of a multi-model run

The model is built from the config saved in the checkpoint, whole, on the CPU, in eval mode. A saved config that
names a callable no config group of conf/ names is refused in one line, unless `trusted` lists it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from hydra.utils import instantiate
from torch import nn

from src import checkpoint
from src.checkpoint.states import ModelState
from src.checkpoint.store import Checkpoint
from src.config import building, trusted_targets


def load_trained(path: str | Path, model: str | None = None, weights: str = "model",
                 trusted: Iterable[str] = ()) -> tuple[nn.Module, dict[str, Any]]:
    """Model `model` (default: the output model) of the checkpoint at `path` with its `weights`, and its config."""
    saved = read_trusted(Path(path), trusted_targets.trusted(trusted))
    return build_saved_model(saved, model or saved.output_model, weights).eval(), saved.config


def read_trusted(path: Path, allowed: set[str]) -> Checkpoint:
    """The checkpoint at `path`, refused in one line if it is none or its config names a `_target_` not `allowed`."""
    saved = checkpoint.read(path)
    trusted_targets.check_saved_config(saved.config, path, allowed)
    return saved


def build_saved_model(saved: Checkpoint, name: str, weights: str = "model") -> nn.Module:
    """Model `name` of `saved`, built from its config without pretrained weights (the checkpoint's replace them:
    no download, no weights file needed), with its `weights`."""
    configs = building.named(saved.config["model"], "model")
    unloaded = {key: value for key, value in (("pretrained", False), ("weights", None)) if key in configs[name]}
    with building.errors_named("model", configs[name]):
        module = instantiate(configs[name], **unloaded)
    ModelState(module, name, f"checkpoint {saved.path}").load_state_dict(saved.model_weights(name, weights))
    return module
