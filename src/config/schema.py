"""What a valid config is, and one line telling the user what to change when it is not.

Three layers, each catching what the one before cannot:

1. Types, at compose time. The dataclasses below are registered in Hydra's ConfigStore and named
   first in the defaults lists of conf/config.yaml and conf/eval.yaml (Hydra's "structured config
   schema" pattern), so `trainer.epochs=abc` or `dist.sync_bn=maybe` fails before anything runs.
   They hold types only: values and their meaning live in the YAML files, in one place.
2. Hydra's compose errors (unknown option, unknown key, wrong type, unparsable override) are
   multi-line reports; `src/config/hydra_errors.py` turns each into one `error:` line and exit code 2.
3. Values types cannot express (`trainer.epochs=0`, a negative learning rate) are refused by
   `check_train_config` when the run starts, before any work.

The groups whose options name a `_target_` (model, dataset, optimizer, scheduler) stay open: each
option has its own keys (SGD's momentum, Adam's betas), a dataclass node refuses keys it does not
declare, and "add a model = one class + one YAML" should not grow a third file. Their keys are
still closed to typos (Hydra's struct mode), and the few values that matter are checked in layer 3.

Nothing here imports torch: `python train.py --help` and `--cfg job` stay fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hydra.core.config_store import ConfigStore
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

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
        with exit_on_usage_error(launch.is_main_process()):
            check_train_config(OmegaConf.masked_copy(config, [key for key in config if key != "hydra"]))
            if launch.is_main_process():  # a late rank could see the checkpoint rank 0 has just written
                checkpoints = Path(config.hydra.run.dir) / "checkpoints"
                Checkpointer(checkpoints, is_main_process=False).resume_path(launch.resume_setting(config.resume))
