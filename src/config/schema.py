"""What a valid config is, and one line telling the user what to change when it is not.

Three layers, each catching what the one before cannot:

1. Types, at compose time. The dataclasses below are registered in Hydra's ConfigStore and named
   first in the defaults lists of conf/config.yaml and conf/eval.yaml (Hydra's "structured config
   schema" pattern), so `trainer.epochs=abc` or `dist.sync_bn=maybe` fails before anything runs.
   They hold types only: values and their meaning live in the YAML files, in one place.
2. Hydra's compose errors (unknown option, unknown key, wrong type, unparsable override) are
   multi-line reports; `one_line_config_errors` turns each into one `error:` line and exit code 2.
3. Values types cannot express (`trainer.epochs=0`, a negative learning rate) are refused by
   `check_train_config` when the run starts, before any work.

The groups whose options name a `_target_` (model, dataset, optimizer, scheduler) stay open: each
option has its own keys (SGD's momentum, Adam's betas), a dataclass node refuses keys it does not
declare, and "add a model = one class + one YAML" should not grow a third file. Their keys are
still closed to typos (Hydra's struct mode), and the few values that matter are checked in layer 3.

Nothing here imports torch: `python train.py --help` and `--cfg job` stay fast.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from hydra.experimental.callback import Callback
from omegaconf import BooleanNode, DictConfig, FloatNode, IntegerNode, OmegaConf, StringNode
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from src.common.errors import UsageError, exit_on_usage_error


@dataclass
class TrainerSchema:
    """The `trainer` block of conf/config.yaml (meanings and units are commented there)."""

    epochs: int
    precision: Any  # 32 | bf16 | 16: a typed node would turn 32 into "32"; checked by check_train_config
    grad_accum: int
    grad_clip: float | None
    compile: bool
    log_every_steps: int
    device: str
    save_checkpoints: bool
    monitor: str
    monitor_mode: str
    checkpoint_every_steps: int | None
    keep_last: int
    max_steps: int | None
    limit_train_batches: int | None
    limit_val_batches: int | None
    overfit_batches: int
    progress: bool
    detect_anomaly: bool
    profile: bool
    channels_last: bool
    tf32: bool
    deterministic: bool


@dataclass
class DistSchema:
    """The `dist` group's options (conf/dist/)."""

    backend: str
    sync_bn: bool
    find_unused_parameters: bool
    timeout_s: float
    step_timeout_s: float | None
    nproc_per_node: int
    master_port: int | None


@dataclass
class TrainSchema:
    """conf/config.yaml: train.py's config."""

    task: Any
    model: Any
    dataset: Any
    optimizer: Any
    scheduler: Any
    dist: DistSchema
    seed: int
    resume: str | None
    trusted_targets: list[str]
    trainer: TrainerSchema


@dataclass
class EvalTrainerSchema:
    precision: Any  # null | 32 | bf16 | 16 (see TrainerSchema)
    device: str


@dataclass
class EvalDistSchema:
    backend: str
    timeout_s: float


@dataclass
class EvalSchema:
    """conf/eval.yaml: eval.py's config."""

    checkpoint: str
    trusted_targets: list[str]
    dataset: Any
    trainer: EvalTrainerSchema
    dist: EvalDistSchema


# Registered on import, as Hydra's docs do: train.py and eval.py import this module before Hydra
# composes, and the defaults lists name these entries.
ConfigStore.instance().store(name="train_schema", node=TrainSchema)
ConfigStore.instance().store(name="eval_schema", node=EvalSchema)


# -- layer 3: values ------------------------------------------------------------------------------

Rule = Callable[[Any], str | None]  # a value -> what is wrong with it, or None


def _one_of(*allowed: str) -> Rule:
    return lambda value: None if str(value) in allowed else f"is not one of {', '.join(allowed)}"


def _at_least(minimum: int, or_null: bool = False) -> Rule:
    def rule(value: Any) -> str | None:
        if (value is None and or_null) or (value is not None and value >= minimum):
            return None
        return f"must be at least {minimum}" + (" (or null)" if or_null else "")

    return rule


def _number_or_null(zero_allowed: bool) -> Rule:
    def rule(value: Any) -> str | None:
        # Also a type check: optimizer.lr lives in an open group, so `optimizer.lr=abc` gets this far.
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value is None or (is_number and (value >= 0 if zero_allowed else value > 0)):
            return None
        return "must be a number >= 0" if zero_allowed else "must be a positive number"

    return rule


def _port_or_null(value: Any) -> str | None:
    return None if value is None or 1 <= value <= 65535 else "is not a port (1-65535); leave it null for a free one"


VALUE_RULES: dict[str, Rule] = {
    "trainer.epochs": _at_least(1),
    "trainer.precision": _one_of("32", "bf16", "16"),
    "trainer.grad_accum": _at_least(1),
    "trainer.grad_clip": _number_or_null(zero_allowed=False),
    "trainer.log_every_steps": _at_least(1),
    "trainer.device": _one_of("auto", "cpu", "cuda"),
    "trainer.monitor_mode": _one_of("max", "min"),
    "trainer.checkpoint_every_steps": _at_least(1, or_null=True),
    "trainer.keep_last": _at_least(1),
    "trainer.max_steps": _at_least(1, or_null=True),
    "trainer.limit_train_batches": _at_least(1, or_null=True),
    "trainer.limit_val_batches": _at_least(1, or_null=True),
    "trainer.overfit_batches": _at_least(0),
    "dist.backend": _one_of("auto", "nccl", "gloo"),
    "dist.timeout_s": _number_or_null(zero_allowed=False),
    "dist.step_timeout_s": _number_or_null(zero_allowed=False),
    "dist.nproc_per_node": _at_least(1),
    "dist.master_port": _port_or_null,
    "optimizer.lr": _number_or_null(zero_allowed=True),  # lr=0 freezes the weights; absent: the optimizer has none
}


def check_train_config(cfg: DictConfig) -> None:
    """Refuse values the schema's types let through, naming every key to change at once."""
    missing = OmegaConf.missing_keys(cfg)
    problems = [f"{key} is required: add {key}=VALUE" for key in sorted(missing)]
    for key, rule in VALUE_RULES.items():
        value = OmegaConf.select(cfg, key)
        problem = None if key in missing else rule(value)
        if problem:
            problems.append(f"{key}={value} {problem}")
    if problems:
        raise UsageError("; ".join(problems))


created_run_dirs: set[Path] = set()  # run dirs that did not exist when this process's run started


class CheckBeforeWriting(Callback):
    """Refuse a bad value, or a fresh run into a run dir that already holds one, before Hydra
    writes `.hydra/` into the run dir: Hydra does that before the task function starts, so a
    check there would already have overwritten an existing run's saved config."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from src.loop.checkpoint import Checkpointer
        from src.parallel import launch

        run_dir = Path(config.hydra.run.dir)
        if not run_dir.exists():  # a refused run may remove it (launch.discard_unused_run_dir)
            created_run_dirs.add(run_dir.resolve())
        # Hydra turns a callback's exception into a warning and goes on; SystemExit it lets through.
        with exit_on_usage_error(launch.is_main_rank()):
            check_train_config(OmegaConf.masked_copy(config, [key for key in config if key != "hydra"]))
            if launch.is_main_rank():  # a late rank could see the checkpoint rank 0 has just written
                checkpoints = Path(config.hydra.run.dir) / "checkpoints"
                Checkpointer(checkpoints, is_main_process=False).resume_path(launch.resume_setting(config.resume))


# -- layer 2: Hydra's compose errors --------------------------------------------------------------

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
