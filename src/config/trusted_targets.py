"""Checkpoints are data, never code: which callables a config read from a file may name.

Hydra's `instantiate` calls whatever a `_target_` names. A target in conf/ or on the command
line is the user's own choice; a target read from a checkpoint's saved config is not: a crafted
.pt whose saved dataset config is `{_target_: torch.load, f: <pickle>, weights_only: false}`
would run that pickle (hydra-core's blocklist of os.system & co. is no boundary). So every
`_target_` a saved config names must already be trusted by the user, by being

- the target of an option of a config group the run can choose from (`model/`, `dataset/`, `callbacks/`, `logger/`,
  `task/`, `optimizer/`, `scheduler/`, `experiment/`) in its config folders: conf/ and each
  `file://` folder of `hydra.searchpath`;
- listed in `trusted_targets` (conf/config.yaml, conf/eval.yaml, or the command line:
  `trusted_targets=[my_pkg.MyModel]`);
- for a resumed training run, named by the run's own composed config.

Anything else ends the run with one line naming the target and how to allow it, before
anything is built. So does an interpolation in a saved config (`${oc.create:{_target_: ...}}`
builds a node with a target when resolved; train.py saves its config resolved). Config folders
of `hydra.searchpath` given as `pkg://` are not read: list their targets in `trusted_targets`.

Nothing here imports torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator

import yaml
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf

from src.common.errors import UsageError

# The config groups whose options name callables (task/ may not exist yet: a missing folder is skipped).
GROUPS = ("model", "dataset", "task", "optimizer", "scheduler", "callbacks", "logger", "experiment")
DEFAULT_CONF = Path(__file__).resolve().parents[2] / "conf"


def targets_in(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every `(key, target)` of a `_target_` anywhere in `node` (dicts and lists, nested)."""
    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=False)
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "_target_":
                yield f"{prefix}_target_", value
            else:
                yield from targets_in(value, f"{prefix}{key}.")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from targets_in(value, f"{prefix}{index}.")


def config_dirs() -> list[Path]:
    """The folders this run composes its config from: conf/ and `hydra.searchpath`'s `file://` ones."""
    if not HydraConfig.initialized():
        return [DEFAULT_CONF]
    sources = HydraConfig.get().runtime.config_sources
    return [Path(source.path) for source in sources if source.schema == "file" and source.provider != "hydra"]


def targets_of_config_groups(dirs: Iterable[Path]) -> set[str]:
    """The `_target_`s named by the options (YAML files) of GROUPS in `dirs`."""
    targets: set[str] = set()
    for directory in dirs:
        for group in GROUPS:
            for option in sorted((directory / group).glob("**/*.yaml")):
                targets.update(str(target) for _, target in targets_in(yaml.safe_load(option.read_text())))
    return targets


def trusted(listed: Iterable[str], own_config: Any = None) -> set[str]:
    """The targets a saved config may name: the config groups', those `listed` in `trusted_targets`,
    and those of `own_config` (the config the user composed for this run)."""
    return targets_of_config_groups(config_dirs()) | set(map(str, listed)) | {
        str(target) for _, target in targets_in(own_config)
    }


def interpolations_in(node: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """Every `(key, value)` of a string holding `${`: an interpolation once in OmegaConf's hands."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from interpolations_in(value, f"{prefix}{key}.")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from interpolations_in(value, f"{prefix}{index}.")
    elif isinstance(node, str) and "${" in node:
        yield prefix.rstrip("."), node


def check_saved_config(saved: Any, path: Path, allowed: set[str]) -> None:
    """Refuse a config read from `path` if it names a `_target_` outside `allowed`, or could
    build one when resolved: train.py saves its config resolved, so an interpolation
    (`${oc.create:{_target_: ...}}` makes a node with a target) means another writer."""
    if not isinstance(saved, dict):
        raise UsageError(f"checkpoint {path} holds no saved config (a dict); it was not written by train.py")
    for key, value in interpolations_in(saved):
        raise UsageError(
            f"checkpoint {path} holds the interpolation {key}={value!r}; train.py saves configs resolved, so this "
            "file was not written by it: nothing was built"
        )
    unknown = [(key, target) for key, target in targets_in(saved) if str(target) not in allowed]
    if not unknown:
        return
    named = ", ".join(f"{key}={target}" for key, target in unknown)
    listing = ",".join(sorted({str(target) for _, target in unknown}))
    raise UsageError(
        f"checkpoint {path} names {named}, which no option of conf/ ({', '.join(GROUPS)}) names; nothing was "
        f"built. If you trust this file, allow it with trusted_targets=[{listing}] (or list it under "
        "trusted_targets in the config)"
    )
