"""Which settings a run records as its hyperparameters: every setting its command line set and a few that tell runs
apart (CHOSEN_GROUPS, CHOSEN_KEYS), not the whole config, whose unchanging keys would bury what a sweep varies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser

CHOSEN_GROUPS = ("task", "model", "dataset", "optimizer", "scheduler")  # recorded by option name
CHOSEN_KEYS = ("optimizer.lr", "trainer.epochs", "seed")  # recorded whether overridden or not
NOT_RECORDED = ("logger",)  # groups whose settings say where the run reports, not what it trains


def run_hparams(config: Mapping[str, Any], overrides: Sequence[str], choices: Mapping[str, str | None],
                global_batch_size: int) -> dict[str, Any]:
    """The settings `overrides` set, CHOSEN_GROUPS (by option name), CHOSEN_KEYS and `global_batch_size`."""
    flat = flatten(config)
    recorded: dict[str, Any] = {}
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.key_or_group
        if override.is_delete() or key.split(".")[0] in NOT_RECORDED:
            continue
        if key in choices:  # a group override: the option's name
            recorded[key] = str(choices[key])
        else:  # a key, or a block whose every setting is recorded
            recorded.update({name: value for name, value in flat.items() if name == key or name.startswith(f"{key}.")})
    recorded.update({group: str(choices[group]) for group in CHOSEN_GROUPS if choices.get(group) is not None})
    recorded.update({key: flat[key] for key in CHOSEN_KEYS if key in flat})
    recorded["global_batch_size"] = global_batch_size
    return recorded


def changed_settings(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """`key=value (was value)` for each setting `current` gives other than `saved` (`resume` itself left out)."""
    was, now = flatten(saved), flatten(current)
    return [f"{key}={now.get(key, 'unset')} (was {was.get(key, 'unset')})" for key in sorted(was.keys() | now.keys())
            if key != "resume" and was.get(key, "unset") != now.get(key, "unset")]


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`; lists and null become strings (TensorBoard's HParams take scalars)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return flat
