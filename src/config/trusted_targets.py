"""Checkpoints are data, never code: a `_target_` a saved config names must be named by an option of the run's
config groups, listed in `trusted_targets`, or (resuming) named by the run's own config; a saved config with an
interpolation is refused too. Else the run ends with one line before anything is built."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator

import yaml
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf

from src.common.errors import UsageError

GROUPS = ("model", "dataset", "task", "optimizer", "scheduler", "callbacks", "logger", "experiment")
DEFAULT_CONF = Path(__file__).resolve().parents[2] / "conf"


def _entries(node: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """Every `(dotted key, key, value)` anywhere in `node` (dicts and lists, nested)."""
    for key, value in node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ():
        yield f"{prefix}{key}", key, value
        if key != "_target_":
            yield from _entries(value, f"{prefix}{key}.")


def targets_in(node: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=False)
    return ((dotted, value) for dotted, key, value in _entries(node) if key == "_target_")


def targets_of_config_groups(dirs: Iterable[Path]) -> set[str]:
    return {str(target) for directory in dirs for group in GROUPS
            for option in sorted((directory / group).glob("**/*.yaml"))
            for _, target in targets_in(yaml.safe_load(option.read_text()))}


def trusted(listed: Iterable[str], own_config: Any = None) -> set[str]:
    """The targets a saved config may name: the config groups' (of the folders this run composes its config from:
    conf/ and `hydra.searchpath`'s `file://` ones), those `listed`, and those of `own_config`."""
    sources = HydraConfig.get().runtime.config_sources if HydraConfig.initialized() else []
    dirs = [Path(source.path) for source in sources if source.schema == "file" and source.provider != "hydra"]
    own = {str(target) for _, target in targets_in(own_config)}
    return targets_of_config_groups(dirs or [DEFAULT_CONF]) | set(map(str, listed)) | own


def check_saved_config(saved: Any, path: Path, allowed: set[str]) -> None:
    """Refuse a config read from `path` that names a `_target_` outside `allowed`, or holds an interpolation."""
    if not isinstance(saved, dict):
        raise UsageError(f"checkpoint {path} holds no saved config (a dict); it was not written by train.py")
    # A string holding `${` is an interpolation once in OmegaConf's hands.
    for key, _, value in _entries(saved):
        if isinstance(value, str) and "${" in value:
            raise UsageError(f"checkpoint {path} holds the interpolation {key}={value!r}; train.py saves configs "
                             "resolved, so this file was not written by it: nothing was built")
    if unknown := [(key, target) for key, target in targets_in(saved) if str(target) not in allowed]:
        named = ", ".join(f"{key}={target}" for key, target in unknown)
        listing = ",".join(sorted({str(target) for _, target in unknown}))
        raise UsageError(f"checkpoint {path} names {named}, which no option of conf/ ({', '.join(GROUPS)}) names; "
                         "nothing was built. If you trust this file, pass the config folder of its run "
                         f"(hydra.searchpath=[file://DIR]) or allow it with trusted_targets=[{listing}]")
