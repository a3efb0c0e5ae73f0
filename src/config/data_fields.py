"""`${data:FIELD}` in a model YAML: a field of what the dataset provides, filled in at run time.

A dataset builder returns `info` (src/components/datasets.py: `num_classes`, `in_channels`, `image_size`,
`num_features`, `num_targets`, ...), and the task adds `num_outputs`, the width of the output it
needs (classes for classification, 1 for binary, the target's values for regression). A model YAML
names the fields its class takes, e.g. `in_features: ${data:num_features}`; nothing is guessed from
signatures. A field the dataset does not provide is one error line naming both sides. Overriding
the key with a value (`model.num_outputs=4`) takes the value instead.

The fields are known once the dataset is built: `providing()` makes them available to the rest of
the run. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from src.common.errors import UsageError

_fields: Mapping[str, Any] | None = None
_dataset_name = "the dataset"


def register_resolver() -> None:
    OmegaConf.register_new_resolver("data", _field, replace=True)


def _field(name: str, _node_: Any) -> Any:
    where = _node_._get_full_key(None)
    if _fields is None:  # before the dataset is built, e.g. `--cfg job --resolve`: say where it comes from
        return f"<{name}: filled in at run time from the dataset and task>"
    if name not in _fields:
        provided = ", ".join(f"{key}={value}" for key, value in _fields.items()) or "nothing"
        raise UsageError(
            f"{where} asks for the dataset's {name}, which {_dataset_name} does not provide (it provides {provided}); "
            f"choose a model that fits this dataset, or set {where}=VALUE"
        )
    value = _fields[name]
    return list(value) if isinstance(value, tuple) else value


@contextlib.contextmanager
def providing(fields: Mapping[str, Any], dataset_name: str) -> Iterator[None]:
    """`${data:FIELD}` resolves to `fields[FIELD]` inside the block (the rest of a run)."""
    global _fields, _dataset_name
    previous = _fields, _dataset_name
    _fields, _dataset_name = dict(fields), dataset_name
    try:
        yield
    finally:
        _fields, _dataset_name = previous


def used_by(model_cfg: DictConfig) -> dict[str, Any]:
    """The fields `model_cfg` takes as `${data:FIELD}`, with the values they have now: saved with a
    checkpoint, so eval.py can refuse data of another shape in one line instead of a shape error."""
    text = OmegaConf.to_yaml(model_cfg)  # unresolved: the interpolations as written
    names = sorted(set(re.findall(r"\$\{data:(\w+)\}", text)))
    return {name: _fields[name] for name in names if _fields is not None and name in _fields}


def check_same(saved: Mapping[str, Any] | None, fields: Mapping[str, Any], what: str, dataset: str) -> None:
    """Refuse evaluating a model built for `saved` fields on data whose `fields` differ."""
    differing = {name: value for name, value in (saved or {}).items() if fields.get(name, value) != value}
    if differing:
        built = ", ".join(f"{name}={value}" for name, value in differing.items())
        given = ", ".join(f"{name}={fields[name]}" for name in differing)
        raise UsageError(
            f"{what} does not fit this model: it was built for {built}, but {dataset} provides {given}; "
            "evaluate it on data of the same shape"
        )
