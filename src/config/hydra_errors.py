"""Hydra's compose errors (unknown option, unknown key, wrong type, unparsable override) as one
`error:` line naming what to change, and exit code 2.

Nothing here imports torch: `python train.py --help` and `--cfg job` stay fast.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import sys
from pathlib import Path
from typing import Iterator

from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import BooleanNode, DictConfig, FloatNode, IntegerNode, StringNode
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from src.common.errors import UsageError, exit_on_usage_error

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


def describe_config_error(error: ConfigCompositionException | OverrideParseException) -> str:
    """One line saying what is wrong with the command line or a config file, and what to change."""
    if isinstance(error, OverrideParseException):
        reason = error.message.splitlines()[0]
        return (f"cannot parse the override {error.override!r} ({reason}); quote values holding special "
                "characters, e.g. key='a value' (https://hydra.cc/docs/advanced/override_grammar/basic/)")
    if isinstance(error, MissingConfigException) and error.options is not None:
        return _unknown_option(error)
    not_chosen = re.match(r"Could not override '([^']+)'\. No match in the defaults list", str(error))
    if not_chosen:  # a group of conf/ that this script's config does not use, e.g. eval.py model=mlp
        script = Path(sys.argv[0]).name
        return f"{script} has no {not_chosen.group(1)} option to choose ({script} --help lists its config groups)"
    cause = error.__cause__ or error.__context__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
        return _unknown_key(cause, error)
    if isinstance(cause, ValidationError) and cause.full_key:
        return _wrong_value(cause, error)
    lines = [str(error), str(cause) if isinstance(cause, OmegaConfBaseException) else ""]
    return " ".join(line.strip() for text in lines for line in text.splitlines() if line.strip())


def _unknown_option(error: MissingConfigException) -> str:
    """`model=cnnn`: name the group's options."""
    match = re.search(r"Could not find '([^']+)'", str(error))
    wanted = match.group(1) if match else str(error.missing_cfg_file)
    group, _, option = wanted.rpartition("/")
    options = sorted(error.options or [])
    if not options:
        return f"{group}={option}: the {group} group has no options yet (add a YAML file to conf/{group}/)"
    return (f"{group}={option} is not an option of {group}{_did_you_mean(option, options, f'{group}=')}; "
            f"choose one of {', '.join(options)}")


def _unknown_key(cause: OmegaConfBaseException, error: ConfigCompositionException) -> str:
    """`trainer.epoch=3`: suggest the key meant, and `+key=value` to add a new one."""
    parent, _, key = cause.full_key.rpartition(".")
    siblings = [str(k) for k in cause.parent_node] if isinstance(cause.parent_node, DictConfig) else []
    suggestion = _did_you_mean(key, siblings, f"{parent}." if parent else "")
    listing = "" if suggestion else f" ({Path(sys.argv[0]).name} --cfg job lists the keys)"
    added = re.search(r"use (\+\S+)", str(error))
    adding = f"; to add a new key, use {added.group(1)}" if added else ""
    return f"{_source(cause, error)} is not a config key{suggestion}{listing}{adding}"


_EXPECTED = {IntegerNode: "an integer", FloatNode: "a number", BooleanNode: "true or false", StringNode: "a string"}


def _wrong_value(cause: ValidationError, error: ConfigCompositionException) -> str:
    """`trainer.epochs=abc`: the key, the type it takes, and an example from the current config."""
    node = cause.parent_node._get_node(cause.key) if isinstance(cause.parent_node, DictConfig) else None
    expected = _EXPECTED.get(type(node), "a value of another type")
    if node is not None and node._is_optional():
        expected += " or null"
    current = None if node is None or node._is_missing() else node._value()
    if isinstance(current, bool):
        current = str(current).lower()  # as the command line spells it
    example = "" if current is None else f", e.g. {cause.full_key}={current}"
    if "not Optional" in cause.msg or "Non optional" in cause.msg:
        return f"{_source(cause, error)}: {cause.full_key} cannot be null; set it to {expected}{example}"
    return f"{_source(cause, error)}: {cause.full_key} takes {expected}{example}"


def _source(cause: OmegaConfBaseException, error: ConfigCompositionException) -> str:
    """Where the bad key or value came from: the override as typed, or the key and its config file."""
    override = re.match(r"Error merging override (\S+)", str(error))
    if override:
        return override.group(1)
    in_file = re.match(r"In '([^']+)'", str(error))
    return f"{cause.full_key} (in {in_file.group(1)}.yaml)" if in_file else cause.full_key


def _did_you_mean(word: str, candidates: list[str], prefix: str) -> str:
    close = difflib.get_close_matches(word, candidates, n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""
