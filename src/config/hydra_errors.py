"""Hydra's compose errors (unknown option or key, wrong type, unparsable override) as one `error:` line naming what
to change, built from the errors' attributes, not their wording; anything else keeps Hydra's message, on one line."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any, Iterator, get_origin, get_type_hints

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from src.common.errors import UsageError, exit_on_usage_error
from src.config import building

CONF = Path(__file__).resolve().parents[2] / "conf"
_FULL_ERROR = "HYDRA_FULL_ERROR"
_full_error_set_here = False
SWEEP_GRAMMAR = "choice(a,b,...), range(start,stop[,step]), interval(low,high) or tag(log,interval(low,high))"


@contextlib.contextmanager
def one_line_config_errors(is_main_process: bool, config_name: str) -> Iterator[None]:
    """Run a `@hydra.main` function with its config errors as one line: Hydra raises them only with
    HYDRA_FULL_ERROR=1, set here until `config_composed()` (a user's own keeps Hydra's traceback)."""
    global _full_error_set_here
    if os.environ.get(_FULL_ERROR) == "1":
        yield
        return
    os.environ[_FULL_ERROR], _full_error_set_here = "1", True
    try:
        with exit_on_usage_error(is_main_process):
            try:
                yield
            except (ConfigCompositionException, OverrideParseException) as error:
                overrides = [a for a in sys.argv[1:] if not a.startswith("-") and ("=" in a or a.startswith("~"))]
                raise UsageError(describe_config_error(error, Path(sys.argv[0]).name, overrides, config_name)) from None
            except ValueError as error:  # the defaults list refusing an override, e.g. optimizer=null
                if type(error) is not ValueError or not _full_error_set_here:  # OmegaConf's, or raised by the run
                    raise
                raise UsageError(f"the config does not compose ({error}); to leave a config group out of this run: "
                                 "~GROUP, e.g. ~optimizer") from None
            except OSError as error:  # Hydra writing the run (or sweep) dir and its .hydra/, before the run starts
                if error.filename is None or not _full_error_set_here:
                    raise
                raise UsageError(f"cannot write {error.filename} ({error.strerror}): choose another hydra.run.dir "
                                 "(hydra.sweep.dir with -m)") from None
    finally:
        config_composed()


def config_composed() -> None:
    """Hand error reporting back to Hydra: the task function's first call (see `one_line_config_errors`)."""
    global _full_error_set_here
    if _full_error_set_here:
        os.environ.pop(_FULL_ERROR, None)
        _full_error_set_here = False


def describe_config_error(error: Exception, script: str, overrides: list[str], config_name: str,
                          config_dir: Path = CONF) -> str:
    """One line saying what is wrong with the command line's `overrides` or a config file, and what to change."""
    if isinstance(error, OverrideParseException):
        if unknown := re.search(r"Unknown function '(\w+)'", error.message):  # e.g. another tool's loguniform(...)
            return f"{error.override}: {unknown.group(1)}(...) is not a function of Hydra's override grammar; a " \
                   f"sweep takes {SWEEP_GRAMMAR}"
        return (f"cannot parse the override {error.override!r} ({error.message.splitlines()[0]}); quote values holding "
                "special characters, e.g. key='a value' (https://hydra.cc/docs/advanced/override_grammar/basic/)")
    if isinstance(error, MissingConfigException) and error.options and error.missing_cfg_file:
        group, _, option = str(error.missing_cfg_file).rpartition("/")
        meant = building.did_you_mean(option, error.options, f"{group}=")
        return f"{group}={option} is not an option of {group}{meant}; choose one of {', '.join(sorted(error.options))}"
    cause = error.__cause__ or error.__context__
    try:
        described = _diagnose(cause, script, overrides, config_name, config_dir)
    except Exception:  # a diagnosis that fails must not hide the user's error behind a traceback
        described = None
    lines = [str(error), str(cause) if isinstance(cause, OmegaConfBaseException) else ""]
    return described or " ".join(line.strip() for text in lines for line in text.splitlines() if line.strip())


def _diagnose(cause: BaseException | None, script: str, lines: list[str], config_name: str,
              config_dir: Path) -> str | None:
    """The key or value refused (`cause`), with the override or file that set it; else a group `script` lacks."""
    overrides = OverridesParser.create().parse_overrides(lines)
    extra = [path for o in overrides if o.key_or_group == "hydra.searchpath" for path in o.value()]
    dirs = [config_dir, *(Path(p.removeprefix("file://")) for p in extra if not p.startswith("pkg://"))]
    key = cause.full_key if isinstance(cause, OmegaConfBaseException) else ""
    is_value = isinstance(cause, ValidationError)
    override = next((o for o in overrides if key and f"{o.key_or_group}.".startswith(f"{key}.")
                     and (not is_value or o.value() == cause.value)), None)
    culprit, choices = (None, {}) if override else _without_one(overrides, dirs, config_name)
    if not key:  # no key refused: a group override the script's defaults list has no entry for?
        if culprit and culprit.type is OverrideType.CHANGE and culprit.key_or_group not in choices:
            groups = ", ".join(sorted(f"{group}=OPTION" for group in choices if not group.startswith("hydra")))
            return f"{script} has no {culprit.key_or_group} option to choose; it chooses {groups}"
        if culprit and culprit.type is OverrideType.ADD and culprit.key_or_group in choices:  # +experiment=NAME
            return f"{culprit.input_line}: {culprit.key_or_group} is a group {script} chooses from already: drop the +"
        return None
    option = culprit.value() if culprit else None
    source = f"{key} (in {culprit.key_or_group}/{option}.yaml)" if isinstance(option, str) else key
    if is_value:
        return wrong_value_message(cause, override.input_line if override else source)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        return unknown_key_message(cause, source, script, override, dirs)
    return None


def _without_one(overrides: list[Override], dirs: list[Path], config_name: str) -> tuple[Override | None, Any]:
    """The first group override without which the config composes, and the group choices of that config."""
    fixed = [o for o in overrides if not o.is_sweep_override()]
    with initialize_config_dir(str(dirs[0].resolve()), version_base="1.3"):
        for override in (o for o in fixed if any((d / o.key_or_group).is_dir() for d in dirs)):
            with contextlib.suppress(HydraException, OmegaConfBaseException):
                others = [other.input_line for other in fixed if other is not override]
                return override, compose(config_name, others, return_hydra_config=True).hydra.runtime.choices
    return None, {}


def unknown_key_message(error: OmegaConfBaseException, source: str, script: str, override: Override | None,
                        dirs: list[Path]) -> str:
    """`trainer.epoch=3`: the key meant (one level down, or a sibling), else how to add it (if its target takes it)."""
    parent, _, key = error.full_key.rpartition(".")
    prefix = f"{parent}." if parent else ""
    node = error.parent_node if isinstance(error.parent_node, DictConfig) else OmegaConf.create()
    if below := _one_level_down(node, parent, key, dirs):
        meant, choose = f"{prefix}{below[0]}.{key}", f"{parent}={below[1]} " if below[1] else ""
        passing = f"; pass {choose}{meant}={override.input_line.split('=', 1)[1]}" if override else ""
        return f"{source} is not a config key (did you mean {meant}?){passing}"
    suggestion = building.did_you_mean(key, [str(k) for k in node], prefix)
    listing = "" if suggestion else f" ({script} --cfg job lists the keys)"
    schema = is_dataclass(OmegaConf.get_type(node))  # a block src/config/schema.py declares refuses a +key too
    adding = f"; to add a new key, use +{override.input_line}" if override and not schema else ""
    target = node.get("_target_")
    found = building.argument_names(target) if isinstance(target, str) else None
    if found is not None and key not in found[0] and not found[1]:  # the target would refuse +key too
        adding = f"; {building.takes(target)}"
    return f"{source} is not a config key{suggestion}{listing}{adding}"


def _one_level_down(node: DictConfig, parent: str, key: str, dirs: list[Path]) -> tuple[str, str | None] | None:
    """(block, None) if one block of `node` holds `key`; (block, option) if one a YAML of group `parent` adds does."""
    found = {str(k): None for k, v in OmegaConf.to_container(node).items() if isinstance(v, dict) and key in v}
    for file in sorted(f for d in dirs if parent for f in (d / parent.replace(".", "/")).glob("*.yaml")):
        blocks = {} if "@package" in file.read_text() else OmegaConf.to_container(OmegaConf.load(file))
        found.update({k: file.stem for k, v in blocks.items() if isinstance(v, dict) and key in v and k not in found})
    return next(iter(found.items())) if len(found) == 1 else None


_EXPECTED = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list"}


def wrong_value_message(error: ValidationError, source: str) -> str:
    """`trainer.epochs=abc`: the key, the type its block's dataclass declares, an example from the config."""
    schema = OmegaConf.get_type(error.parent_node) if isinstance(error.parent_node, DictConfig) else None
    declared = get_type_hints(schema).get(str(error.key)) if isinstance(schema, type) else None
    alternatives = building.union_members(declared)  # e.g. float | None: (float, NoneType)
    optional = type(None) in alternatives
    kind = next(get_origin(t) or t for t in alternatives if t is not type(None))
    members = getattr(kind, "__members__", None)  # an Enum's
    expected = f"one of {', '.join(members)}" if members else _EXPECTED.get(kind, "a value of another type")
    current = OmegaConf.select(error.parent_node, str(error.key), throw_on_resolution_failure=False)
    current = getattr(current, "name", current) if members else current
    current = str(current).lower() if isinstance(current, bool) else current  # as the command line spells it
    example = f", e.g. {error.full_key}={current}" if isinstance(current, (int, float, str)) else ""
    if error.value is None and not optional:
        return f"{source}: {error.full_key} cannot be null; set it to {expected}{example}"
    return f"{source}: {error.full_key} takes {expected}{' or null' if optional else ''}{example}"
