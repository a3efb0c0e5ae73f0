"""Building what a config names (`_target_`), with one line for what the user got wrong: a key the target does not
take or one it misses (Hydra's TypeError deep in a traceback) names the config key, the class and its arguments;
a value a component refuses by its own rule (`SettingError`) reads `KEY.ARGUMENT=VALUE what is wrong`."""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import traceback
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_object

from src.common.errors import UsageError

Rule = Callable[[Any], "str | None"]  # a value -> what is wrong with it, or None
_HYDRA_KEYS = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")


class SettingError(UsageError):
    """Arguments a component refused: (argument, value, what is wrong) each."""

    def __init__(self, problems: list[tuple[str, Any, str]]) -> None:
        self.problems = problems
        super().__init__(self.named(""))

    def named(self, key: str) -> str:
        prefix = f"{key}." if key else ""
        return "; ".join(f"{prefix}{argument}={value} {problem}" for argument, value, problem in self.problems)


def check_arguments(**checked: tuple[Any, Rule]) -> None:
    if problems := [(name, value, problem) for name, (value, rule) in checked.items() if (problem := rule(value))]:
        raise SettingError(problems)


@contextlib.contextmanager
def errors_named(key: str, node: Mapping[str, Any], passed_elsewhere: Iterable[str] = (),
                 called_with: Sequence[str] = ()) -> Iterator[None]:
    """Build `node` (the config at `key`) inside the block: an argument its target does not take or misses, or a
    value it refuses, is one line naming `key`; `passed_elsewhere`: the node's keys that are not arguments;
    `called_with`: the arguments the block gives a partial's target (a scheduler's optimizer, total_steps, ...)."""
    check_types(key, node)  # before the build: a value some step would have read at its first use
    try:
        yield
    except (InstantiationException, TypeError, ValueError) as error:  # a partial's come from its call, unwrapped
        cause = error.__cause__ if isinstance(error, InstantiationException) else error
        if unlocated := not_located(key, node, error):
            raise unlocated from None
        if isinstance(cause, SettingError):
            raise UsageError(cause.named(key)) from None
        if isinstance(cause, ValueError) and (cause is not error or called_with):  # the target's own check refused
            where = traceback.extract_tb(cause.__traceback__)[-1]
            raise UsageError(f"{key}: {node.get('_target_')} refused its settings ({cause}; raised at "
                             f"{Path(where.filename).name}:{where.lineno}): change the {key}.* keys") from None
        mismatch = isinstance(cause, TypeError) and argument_mismatch(key, node, passed_elsewhere, called_with)
        if not mismatch:
            raise
        raise UsageError(mismatch) from None
    except SettingError as error:  # built without instantiate
        raise UsageError(error.named(key)) from None


def not_located(key: str, node: Mapping[str, Any], error: Exception) -> UsageError | None:
    """One line for a `_target_` Hydra could not import (a misspelt class or module), else None."""
    if not str(error).startswith("Error locating target"):
        return None
    target = str(node.get("_target_"))
    module_name, _, name = target.rpartition(".")
    try:
        names = dir(importlib.import_module(module_name))
    except Exception as cause:  # noqa: BLE001 - the module itself: not found, or failing as it is imported
        return UsageError(f"{key}._target_={target}: module {module_name} cannot be imported ({type(cause).__name__}: "
                          f"{str(cause).splitlines()[0]}); a module of your own needs PYTHONPATH=. (docs/forking.md)")
    close = difflib.get_close_matches(name, names, n=1)
    return UsageError(f"{key}._target_={target}: module {module_name} has no {name}"
                      + (f"; did you mean {module_name}.{close[0]}?" if close else ""))


def argument_names(target: str) -> tuple[list[str], bool] | None:
    """The parameters of `target`'s callable and whether it takes `**kwargs`; None if they cannot be read."""
    try:
        parameters = inspect.signature(get_object(target)).parameters.values()
    except Exception:  # say nothing rather than guess
        return None
    names = [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return names, any(p.kind == p.VAR_KEYWORD for p in parameters)


def takes(target: str) -> str:
    """`src.components.models.SimpleCNN takes in_channels, image_size, num_outputs`."""
    found = argument_names(target)
    return f"{target} takes {', '.join(found[0]) if found and found[0] else 'no arguments'}"


def argument_mismatch(key: str, node: Mapping[str, Any], passed_elsewhere: Iterable[str] = (),
                      called_with: Sequence[str] = ()) -> str | None:
    """One line if `node`'s keys (and the arguments it is `called_with`) do not fit its target's signature; None if
    they fit or it cannot be read."""
    target = str(node.get("_target_"))
    found = argument_names(target)
    if found is None:
        return None
    names, any_keyword = found
    if not any_keyword and not set(called_with) <= set(names):
        return (f"{key}: {takes(target)}, but the run calls it with {', '.join(called_with)}: give a callable that "
                "takes them (docs/forking.md)")
    given = [str(name) for name in node if name not in _HYDRA_KEYS and name not in set(passed_elsewhere)]
    if not any_keyword and (unexpected := [name for name in given if name not in names]):
        return (f"{key}.{unexpected[0]} is not an argument of {key}: {takes(target)}; remove it, or drop it for "
                f"this run with ~{key}.{unexpected[0]}")
    parameters = inspect.signature(get_object(target)).parameters
    missing = [name for name in names if parameters[name].default is inspect.Parameter.empty
               and parameters[name].kind != inspect.Parameter.POSITIONAL_ONLY and name not in (*given, *called_with)]
    if missing and "_args_" not in node and (called_with or not node.get("_partial_")):
        return f"{key} needs {', '.join(missing)}: {takes(target)}; add +{key}.{missing[0]}=VALUE"
    return None


_SCALARS = {int: (int,), float: (int, float), bool: (bool,), str: (str,), type(None): (type(None),)}


def check_types(key: str, node: Mapping[str, Any]) -> None:
    """One line for a value its target's annotation (`int`, `float | None`, `Sequence[int]`, ...) rules out."""
    try:
        parameters = inspect.signature(get_object(str(node.get("_target_"))), eval_str=True).parameters
        values = dict(node.items())  # a missing or unresolvable value: the build reports it
    except Exception:  # say nothing rather than guess
        return
    for name, value in values.items():
        hint, default = (parameters[name].annotation, parameters[name].default) if name in parameters else (None, None)
        if fits(value, hint) is False and value != default:  # a class's own default is no mistake (x: float = None)
            annotation = inspect.formatannotation(hint).replace("collections.abc.", "")
            raise UsageError(f"{key}.{name}={value}: {node.get('_target_')} takes {name}: {annotation}")


def fits(value: Any, hint: Any) -> bool | None:
    """Whether `value` fits `hint` (a scalar, a list, tuple or sequence of one, their unions); None for others."""
    verdicts = []
    for kind in union_members(hint):
        items = [item for item in typing.get_args(kind) if item is not Ellipsis]
        if kind in _SCALARS:
            verdicts.append(isinstance(value, _SCALARS[kind]) and (kind is bool or not isinstance(value, bool)))
        elif typing.get_origin(kind) in (list, tuple, Sequence) and len(set(items)) <= 1:
            listed = isinstance(value, Sequence) and not isinstance(value, str)
            verdicts.append(listed and (not items or all(fits(item, items[0]) is not False for item in value)))
        else:
            return None
    return any(verdicts)


def union_members(hint: Any) -> tuple[Any, ...]:
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


def did_you_mean(word: str, candidates: Iterable[str], prefix: str) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def named(node: Mapping[str, Any], key: str, default_name: str = "model") -> dict[str, Any]:
    """The configs of a group that takes one (a node with a `_target_`, named `default_name`) or several by name."""
    if "_target_" in node:
        return {default_name: node}
    stray = [str(name) for name, value in node.items() if not (isinstance(value, Mapping) and "_target_" in value)]
    if not node or stray:
        raise UsageError(f"{key} names no _target_: give it one (a {key} YAML of conf/{key}/), or one per name, each "
                         f"with its _target_ (docs/forking.md); {key}.{(stray or ['NAME'])[0]} is neither")
    return {str(name): value for name, value in node.items()}


def per_model(node: Mapping[str, Any], key: str, models: Iterable[str]) -> dict[str, Any]:
    """For each model, its config of group `key`: the one config, or the model's own when `key` names one each."""
    models = list(models)
    each = f"one {key} for each model by its name ({' '.join(f'+{key}@{key}.{name}=OPTION' for name in models)} " \
           f"after ~{key}: docs/forking.md)"
    if "_target_" in node:
        if both := [name for name in models if name in node]:
            raise UsageError(f"{key} is one config for all models ({node['_target_']}), and names model {both[0]} "
                             f"too: give {each}, or set {key}.KEY for all")
        return {name: node for name in models}
    configs = named(node, key)
    if set(configs) != set(models):
        raise UsageError(f"{key} names {', '.join(configs)}, but the run's models are {', '.join(models)}: give "
                         f"{each}, or one {key} for all")
    return {name: configs[name] for name in models}
