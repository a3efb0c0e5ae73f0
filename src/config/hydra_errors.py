"""Hydra's compose errors (unknown option, unknown key, wrong type, unparsable override) as one
`error:` line naming what to change, and exit code 2.

The line comes from checking the command line against the config, not from Hydra's wording of
the error: the overrides Hydra was composing are parsed with Hydra's own parser; a config group's
choice is checked against the group's options and the groups the script's defaults list uses; each
key override is applied, as Hydra applies it, to the config composed without the key overrides,
and the key or value OmegaConf refuses is described from the refusing node (siblings, type,
current value). An error inside a config file is described from the attributes of the errors
raised. A refusal whose Hydra message is already clear (`+key` on an existing key, `~key` on a
missing one) and anything not diagnosed keep Hydra's own message, joined onto one line. All of
this runs only after composition has failed: a valid command pays nothing for it.

Nothing here imports torch: `python train.py --help` and `--cfg job` stay fast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterator

from hydra.core.config_loader import ConfigLoader
from hydra.core.default_element import ResultDefault
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import BooleanNode, DictConfig, EnumNode, FloatNode, IntegerNode, OmegaConf, StringNode, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from src.common.errors import UsageError, exit_on_usage_error
from src.config import building

_FULL_ERROR = "HYDRA_FULL_ERROR"
_full_error_set_here = False


@contextlib.contextmanager
def one_line_config_errors(is_main_process: bool) -> Iterator[None]:
    """Run a `@hydra.main` function with Hydra's config errors reported as one `error:` line and
    exit code 2 (printed by the main process only, like every usage error).

    Hydra catches its own errors and prints them over several lines ending with "Set the
    environment variable HYDRA_FULL_ERROR=1 ...", then exits 1; only with HYDRA_FULL_ERROR=1 does
    it raise them. So until the config has composed, the block runs with that variable set and
    rephrases the errors Hydra raises; `config_composed()`, the first call of the task function,
    unsets it, so that errors of the run itself get Hydra's usual report (and worker processes do
    not inherit the variable). A user who sets HYDRA_FULL_ERROR=1 gets Hydra's full traceback.
    """
    global _full_error_set_here
    if os.environ.get(_FULL_ERROR) == "1":
        yield
        return
    os.environ[_FULL_ERROR] = "1"
    _full_error_set_here = True
    try:
        with exit_on_usage_error(is_main_process):
            try:
                yield
            except (ConfigCompositionException, OverrideParseException) as error:
                raise UsageError(describe_config_error(error)) from None
    finally:
        config_composed()


def config_composed() -> None:
    """Hand error reporting back to Hydra (see `one_line_config_errors`)."""
    global _full_error_set_here
    if _full_error_set_here:
        os.environ.pop(_FULL_ERROR, None)
        _full_error_set_here = False


def describe_config_error(error: ConfigCompositionException | OverrideParseException, script: str | None = None) -> str:
    """One line saying what is wrong with the command line or a config file, and what to change.

    Checked against the config, not read from Hydra's wording: each override of the command line
    Hydra was composing is checked against the config group's options and against the config
    composed without the key overrides. An error of a config file is described from the attributes
    of the errors raised; anything else is Hydra's own message, on one line.
    """
    script = script or Path(sys.argv[0]).name
    if isinstance(error, OverrideParseException):
        unknown = re.search(r"Unknown function '(\w+)'", error.message)
        if unknown:  # e.g. a search distribution of another tool: loguniform(...)
            return (f"{error.override}: {unknown.group(1)}(...) is not a function of Hydra's override grammar; a "
                    "sweep takes choice(a,b,...), range(start,stop[,step]), interval(low,high) or "
                    "tag(log,interval(low,high))")
        reason = error.message.splitlines()[0]
        return (f"cannot parse the override {error.override!r} ({reason}); quote values holding special "
                "characters, e.g. key='a value' (https://hydra.cc/docs/advanced/override_grammar/basic/)")
    composition = failed_composition(error)
    try:
        described = diagnose(composition, script) if composition else None
    except Exception:  # a diagnosis that fails must not hide the user's error behind a traceback
        described = None
    return described or _from_attributes(error, script) or _hydra_message(error)


@dataclasses.dataclass(frozen=True)
class Composition:
    """A `ConfigLoader.load_configuration` call: Hydra's config loader (search path, config groups),
    the primary config's name and the command line's overrides."""

    loader: ConfigLoader
    config_name: str | None
    overrides: list[str]


def failed_composition(error: BaseException) -> Composition | None:
    """The composition that raised `error`: the arguments of the `ConfigLoader.load_configuration`
    call on its traceback (Hydra clears its global state before the error reaches the caller)."""
    trace = error.__traceback__
    while trace is not None:
        frame = trace.tb_frame
        loader = frame.f_locals.get("self")
        if frame.f_code.co_name == "load_configuration" and isinstance(loader, ConfigLoader):
            return Composition(loader, frame.f_locals.get("config_name"), list(frame.f_locals.get("overrides") or ()))
        trace = trace.tb_next
    return None


def diagnose(composition: Composition, script: str) -> str | None:
    """The first override of the command line that the config refuses, said in one line; None if
    they all fit (then the error is in a config file, or one Hydra's own message describes)."""
    overrides = OverridesParser.create().parse_overrides(composition.overrides)
    groups = [o for o in overrides if _is_group(composition.loader, o.key_or_group) and not o.is_sweep_override()]
    for override in groups:
        if problem := _unknown_option(composition.loader, override):
            return problem
    try:
        cfg = composition.loader.load_configuration(composition.config_name, [o.input_line for o in groups],
                                                    RunMode.RUN)
    except (HydraException, OmegaConfBaseException):
        return _group_not_in_defaults(composition, groups, script)
    OmegaConf.set_readonly(cfg.hydra, False)  # as Hydra leaves it while applying the overrides
    for override in overrides:
        if override not in groups and not override.is_sweep_override():
            if (problem := _apply(cfg, override, script)) is not None:
                return problem or None
    return None


def _is_group(loader: ConfigLoader, key: str) -> bool:
    parent, _, name = key.rpartition("/")
    return name in loader.list_groups(parent)


def _unknown_option(loader: ConfigLoader, override: Override) -> str | None:
    """`model=cnnn`: an option that is not a file (or stored config) of the group; None if all are."""
    group, value = override.key_or_group, override.value()
    chosen = value if isinstance(value, list) else [value]
    options = loader.get_group_options(group)
    unknown = [option for option in chosen if isinstance(option, str) and option not in options]
    return unknown_option_message(group, unknown[0], options) if unknown else None


def unknown_option_message(group: str, option: str, options: list[str]) -> str:
    if not options:
        return f"{group}={option}: the {group} group has no options yet (add a YAML file to conf/{group}/)"
    return (f"{group}={option} is not an option of {group}{_did_you_mean(option, options, f'{group}=')}; "
            f"choose one of {', '.join(sorted(options))}")


def _group_not_in_defaults(composition: Composition, groups: list[Override], script: str) -> str | None:
    """`eval.py model=mlp`: a group of conf/ that this script's config does not choose from (its
    defaults list, composed without that override, has no entry for the group)."""
    for override in groups:
        if override.is_add() or override.is_force_add() or override.is_delete():
            continue
        others = [o.input_line for o in groups if o is not override]
        try:
            defaults = composition.loader.compute_defaults_list(composition.config_name, others, RunMode.RUN)
        except (HydraException, OmegaConfBaseException):
            continue
        if override.get_key_element() not in defaults.overrides.known_choices:
            return f"{script} has no {override.key_or_group} option to choose ({script} --help lists its config groups)"
    return None


_HYDRAS_OWN = ""  # _apply: Hydra refuses the override and its own message says why


def _apply(cfg: DictConfig, override: Override, script: str) -> str | None:
    """Apply a key override as Hydra does: None if it fits, else a change the config refuses (a key
    it lacks, a value of another type), described; `_HYDRAS_OWN` for a refusal Hydra's message says
    clearly itself (`+key` on an existing key, `~key` on a missing one)."""
    key, value = override.key_or_group, override.value()
    present = OmegaConf.select(cfg, key, throw_on_missing=False) is not None
    merges = isinstance(value, (dict, list))
    if (override.is_delete() and not present) or (override.is_add() and present and not merges):
        return _HYDRAS_OWN
    try:
        if override.is_delete():
            parent, _, name = key.rpartition(".")
            with open_dict(cfg):
                (OmegaConf.select(cfg, parent) if parent else cfg).pop(name)
        else:
            OmegaConf.update(cfg, key, value, merge=True, force_add=override.is_add() or override.is_force_add())
    except (ConfigAttributeError, ConfigKeyError) as error:
        return unknown_key_message(error, error.full_key, script, override)
    except ValidationError as error:
        return wrong_value_message(error, override.input_line, value)
    except OmegaConfBaseException:
        return _HYDRAS_OWN
    return None


def unknown_key_message(error: OmegaConfBaseException, source: str, script: str,
                        override: Override | None = None) -> str:
    """`trainer.epoch=3`: suggest the key meant (a sibling in the config), and `+key=value` to add a new one;
    for the block of a `_target_` (model, dataset, task, a callback), `+key` only if its target takes that
    argument, else the arguments it takes."""
    parent, _, key = error.full_key.rpartition(".")
    siblings = [str(k) for k in error.parent_node] if isinstance(error.parent_node, DictConfig) else []
    suggestion = _did_you_mean(key, siblings, f"{parent}." if parent else "")
    listing = "" if suggestion else f" ({script} --cfg job lists the keys)"
    adding = f"; to add a new key, use +{override.input_line}" if override is not None else ""
    target = error.parent_node.get("_target_") if isinstance(error.parent_node, DictConfig) else None
    found = building.argument_names(str(target)) if isinstance(target, str) else None
    if found is not None and key not in found[0] and not found[1]:  # the target would refuse +key too
        adding = f"; {building.takes(target)}"
    return f"{source} is not a config key{suggestion}{listing}{adding}"


_EXPECTED = {IntegerNode: "an integer", FloatNode: "a number", BooleanNode: "true or false", StringNode: "a string"}


def wrong_value_message(error: ValidationError, source: str, value: Any) -> str:
    """`trainer.epochs=abc`: the key, the type its node takes, and an example from the current config."""
    node = error.parent_node._get_node(error.key) if isinstance(error.parent_node, DictConfig) else None
    expected = _EXPECTED.get(type(node), "a value of another type")
    if isinstance(node, EnumNode):
        expected = f"one of {', '.join(member.name for member in node.enum_type)}"
    optional = node is not None and node._is_optional()
    if optional:
        expected += " or null"
    current = None if node is None or node._is_missing() else node._value()
    if isinstance(current, bool):
        current = str(current).lower()  # as the command line spells it
    example = "" if current is None else f", e.g. {error.full_key}={getattr(current, 'name', current)}"
    if value is None and not optional:
        return f"{source}: {error.full_key} cannot be null; set it to {expected}{example}"
    return f"{source}: {error.full_key} takes {expected}{example}"


def _from_attributes(error: ConfigCompositionException, script: str) -> str | None:
    """An error of a config file (or one raised outside a composition), from the attributes of the
    errors raised: the option looked for and the group's options, or the key, its node and the file."""
    if isinstance(error, MissingConfigException) and error.options is not None and error.missing_cfg_file:
        group, _, option = str(error.missing_cfg_file).rpartition("/")
        return unknown_option_message(group, option, list(error.options))
    cause = error.__cause__ or error.__context__
    if not isinstance(cause, OmegaConfBaseException) or not cause.full_key:
        return None
    file = _file_being_merged(error)
    source = f"{cause.full_key} (in {file}.yaml)" if file else cause.full_key
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        return unknown_key_message(cause, source, script)
    if isinstance(cause, ValidationError):
        return wrong_value_message(cause, source, cause.value)
    return None


def _file_being_merged(error: BaseException) -> str | None:
    """The config Hydra was merging when `error` was raised: the defaults-list entry (a
    `ResultDefault`) innermost on its traceback."""
    found, trace = None, error.__traceback__
    while trace is not None:
        entries = [v for v in trace.tb_frame.f_locals.values() if isinstance(v, ResultDefault) and v.config_path]
        found = entries[-1].config_path if entries else found
        trace = trace.tb_next
    return found


def _hydra_message(error: BaseException) -> str:
    """Hydra's own message (and its cause's), on one line."""
    cause = error.__cause__ or error.__context__
    lines = [str(error), str(cause) if isinstance(cause, OmegaConfBaseException) else ""]
    return " ".join(line.strip() for text in lines for line in text.splitlines() if line.strip())


def _did_you_mean(word: str, candidates: list[str], prefix: str) -> str:
    close = difflib.get_close_matches(word, candidates, n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""
