"""`${data:FIELD}` in a model YAML: a field of what the dataset provides (its `info`, and the task's
`num_outputs`), written into the run's model config once the dataset is built (`fill`). The other way round,
`${weights:FIELD,DEFAULT}` in a dataset YAML: the input the model's pretrained weights were trained on."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf, open_dict

from src.common.errors import UsageError

_FIELD = re.compile(r"\$\{data:(\w+)\}")


def register_resolver() -> None:
    """`${data:FIELD}` resolved before the dataset is built (`--cfg job --resolve`) says where it will come from."""
    OmegaConf.register_new_resolver("data", lambda name: f"<{name}: filled in at run time from the dataset and task>",
                                    replace=True)
    OmegaConf.register_new_resolver("weights", weights_field, replace=True)


def weights_field(name: str, default: Any = None, *, _root_: DictConfig) -> Any:
    """`${weights:FIELD,DEFAULT}`: FIELD (mean, std, image_size) of the input the run's model's pretrained weights
    were trained on, or DEFAULT where it has none: a model `_target_` says so with a `preprocessing(model_cfg)`
    attribute returning that dict or None (src/components/pretrained.py). Only the target's module is imported."""
    model = _root_.get("model")
    target = model.get("_target_") if isinstance(model, DictConfig) else None
    try:
        preprocessing = getattr(get_object(target), "preprocessing", None) if target else None
    except (ImportError, AttributeError, ValueError):  # building the model says what is wrong with its target
        preprocessing = None
    values = preprocessing(model) if preprocessing is not None else None
    if values is not None and name not in values:
        raise UsageError(f"${{weights:{name}}}: the weights of {target} give {', '.join(values)}, not {name}")
    value = default if values is None else values[name]
    return OmegaConf.create(list(value)) if isinstance(value, (list, tuple)) else value  # a list node, as YAML's


def fill(model_cfg: DictConfig, fields: Mapping[str, Any], dataset_name: str) -> DictConfig:
    """`model_cfg` with each `${data:FIELD}` replaced by `fields[FIELD]`, or one error line naming both sides."""
    return OmegaConf.create(_filled(OmegaConf.to_container(model_cfg, resolve=False), fields, dataset_name, "model"))


def _filled(node: Any, fields: Mapping[str, Any], dataset_name: str, where: str) -> Any:
    if isinstance(node, dict):
        return {key: _filled(value, fields, dataset_name, f"{where}.{key}") for key, value in node.items()}
    if isinstance(node, list):
        return [_filled(value, fields, dataset_name, f"{where}.{index}") for index, value in enumerate(node)]
    match = _FIELD.fullmatch(node) if isinstance(node, str) else None
    if match is None:
        return node
    if (name := match.group(1)) not in fields:
        provided = ", ".join(f"{key}={value}" for key, value in fields.items()) or "nothing"
        raise UsageError(f"{where} asks for the dataset's {name}, which {dataset_name} does not provide (it provides "
                         f"{provided}); choose a model that fits this dataset, or set {where}=VALUE")
    return list(value) if isinstance(value := fields[name], tuple) else value


def used_by(model_cfg: DictConfig, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The fields `model_cfg` takes as `${data:FIELD}`, with their values: saved with a checkpoint, for eval.py."""
    return {name: fields[name] for name in sorted(set(_FIELD.findall(OmegaConf.to_yaml(model_cfg)))) if name in fields}


def check_same(saved: Mapping[str, Any] | None, fields: Mapping[str, Any], what: str, dataset: str) -> None:
    """Refuse evaluating a model built for `saved` fields on data whose `fields` differ."""
    if differing := {name: value for name, value in (saved or {}).items() if fields.get(name, value) != value}:
        built = ", ".join(f"{name}={value}" for name, value in differing.items())
        given = ", ".join(f"{name}={fields[name]}" for name in differing)
        raise UsageError(f"{what} does not fit this model: it was built for {built}, but {dataset} provides {given}; "
                         "evaluate it on data of the same shape")


def fill_model_config(cfg: DictConfig, fields: dict[str, Any], dataset: str) -> dict[str, Any]:
    """Fill `cfg.model`'s `${data:FIELD}`s; returns the run's resolved config with its `data_fields`."""
    used = used_by(cfg.model, fields)
    with open_dict(cfg):
        cfg.model = fill(cfg.model, fields, f"dataset={dataset}")
    return {**OmegaConf.to_container(cfg, resolve=True), "data_fields": used}
