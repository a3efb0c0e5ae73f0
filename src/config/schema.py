"""Every `trainer` and `dist` setting, declared once: its type, default, meaning (the comment beside it) and the
rule its value must pass where the type lets more through (checked when the run starts: `check_train_config`).
conf/config.yaml names `train_schema` first in its defaults list; eval.py's schema reuses the declarations. The
groups whose options name a `_target_` stay open; the few values there that matter are in `OPEN_GROUP_RULES`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Iterator

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import MISSING, DictConfig, OmegaConf

from src.checkpoint import layout
from src.common.errors import UsageError, exit_on_usage_error
from src.config.building import Rule, did_you_mean
from src.parallel.job import check_run_dir
from src.parallel.ranks import is_main_process, resume_setting


def one_of(*allowed: str, or_null: bool = False) -> Rule:
    problem = f"is not one of {', '.join(allowed)}" + (" (or null)" if or_null else "")
    return lambda value: None if (or_null if value is None else str(value) in allowed) else problem


def at_least(minimum: int, or_null: bool = False) -> Rule:
    problem = f"must be at least {minimum}" + (" (or null)" if or_null else "")
    return lambda value: None if (value is None and or_null) or (value is not None and value >= minimum) else problem


def _is_number(value: Any, whole: bool = False) -> bool:
    # Also a type check: `optimizer.lr=abc` (an open group) gets this far.
    return isinstance(value, (int,) if whole else (int, float)) and not isinstance(value, bool)


def number_or_null(zero_allowed: bool, whole: bool = False) -> Rule:
    kind = "whole number" if whole else "number"
    problem = f"must be a {kind} >= 0" if zero_allowed else f"must be a positive {kind}"
    return lambda value: None if value is None or (_is_number(value, whole) and (value > 0 or zero_allowed
                                                                                  and value == 0)) else problem


def fraction_or_null(value: Any) -> str | None:
    return None if value is None or (_is_number(value) and 0 < value < 1) else "must be in (0, 1) (or null)"


def port_or_null(value: Any) -> str | None:
    return None if value is None or 1 <= value <= 65535 else "is not a port (1-65535); leave it null for a free one"


def setting(default: Any, rule: Rule | None = None) -> Any:
    """A field's default and the rule its value must pass (none: its type says it all)."""
    return field(default=default, metadata={"rule": rule} if rule else {})


# -- settings train.py and eval.py share -------------------------------------------------------------

PRECISIONS = ("32", "bf16", "16")  # float32 | autocast to bfloat16 | to float16 (src/loop/performance.py)
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "nccl", "gloo")


def precision_setting(default: Any) -> Any:
    """Typed Any: a str node would turn 32 into "32". A null default (eval.py: the checkpoint's) allows null."""
    return setting(default, one_of(*PRECISIONS, or_null=default is None))


@dataclass
class TrainerConfig:
    """The `trainer` block. Built directly (tests), `monitor`/`monitor_mode` stay interpolations: pass them."""

    epochs: int = setting(20, at_least(1))  # passes over the training set
    precision: Any = precision_setting(32)  # 32 | bf16 | 16 (fp16 autocast with gradient scaling; for GPUs)
    grad_accum: int = setting(1, at_least(1))  # micro-steps per optimizer step; dataset.batch_size is the global batch
    grad_clip: float | None = setting(None, number_or_null(zero_allowed=False))  # max global gradient L2 norm
    compile: bool = False  # wrap the model in torch.compile (TorchInductor)
    log_every_steps: int = setting(50, at_least(1))  # optimizer steps between TensorBoard train/* scalars
    device: str = setting("auto", one_of(*DEVICES))  # auto: cuda:LOCAL_RANK if a GPU is visible, else cpu | cpu | cuda
    save_checkpoints: bool = True  # write checkpoints/last.pt every epoch and best.pt on improvement
    monitor: str | None = "${task.monitor}"  # val/NAME or train/NAME deciding best.pt and sweeps; null: none
    monitor_mode: str = setting("${task.mode}", one_of("max", "min"))  # max | min: which monitor value is better
    test: bool = True  # when training ends (not on preemption), evaluate the chosen weights once on the test split
    checkpoint_every_steps: int | None = setting(None, at_least(1, or_null=True))  # also mid-epoch (null: epoch ends)
    async_checkpoint: bool = False  # a save waits only for a host copy, written in the background
    keep_last: int = setting(2, at_least(1))  # newest mid-epoch checkpoints kept as checkpoints/step_<N>.pt
    max_steps: int | None = setting(None, at_least(1, or_null=True))  # stop after N steps, with a checkpoint
    limit_train_batches: int | None = setting(None, at_least(1, or_null=True))  # optimizer steps per epoch at most
    limit_val_batches: int | None = setting(None, at_least(1, or_null=True))  # val batches per rank at most
    overfit_batches: int = setting(0, at_least(0))  # >0: train AND validate on the first N global batches
    progress: bool = True  # rank-0 progress bars (when stdout is a terminal)
    channels_last: bool = False  # NHWC memory format for the model and images
    tf32: bool = True  # allow TensorFloat-32 matmuls/convolutions on Ampere+ GPUs
    deterministic: bool = False  # deterministic cuDNN algorithms; false lets cudnn.benchmark pick the fastest
    freeze: list[str] = field(default_factory=list)  # parameter-name prefixes to freeze (no gradients)


STRATEGIES = ("ddp", "fsdp")  # a full copy of the model per rank | the model sharded over the ranks (FSDP2)


@dataclass
class FsdpConfig:
    """`dist.fsdp`: how `dist.strategy=fsdp` shards the model (src/parallel/fsdp.py)."""

    wrap: list[str] = field(default_factory=list)  # class names of the modules sharded as units, then the root;
    # []: auto, the root's children of at least min_unit_params parameters; [root]: the whole model as one unit
    min_unit_params: int = setting(1_000_000, at_least(0))  # with wrap=[]: the smallest child that is a unit (0: any)
    reshard_after_forward: bool = True  # free gathered parameters after each unit's forward (least memory)
    cpu_offload: bool = False  # keep shards, gradients and optimizer state in host memory (GPUs only)


@dataclass
class DistConfig:
    """The `dist` group; a single process ignores these keys except `strategy` (its checkpoint format)."""

    strategy: str = setting("ddp", one_of(*STRATEGIES))  # ddp: whole model per rank | fsdp: FSDP2, sharded
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    backend: str = setting("auto", one_of(*BACKENDS))  # auto: nccl on GPUs, gloo on CPU | nccl | gloo
    sync_bn: bool = True  # BatchNorm statistics over the global batch; false = per-rank statistics
    find_unused_parameters: bool = False  # set true if some parameters get no gradient in a step (slower)
    timeout_s: float = setting(1800.0, number_or_null(zero_allowed=False))  # collective wait (s) until the first step
    step_timeout_s: float | None = setting(300.0, number_or_null(zero_allowed=False))  # after it (null: timeout_s)
    nproc_per_node: int = setting(1, at_least(1))  # >1: `python train.py` starts N local workers (not under torchrun)
    master_port: int | None = setting(None, port_or_null)  # rendezvous port with nproc_per_node>1 (null: free)


@dataclass
class TrainSchema:
    task: Any
    model: Any
    dataset: Any
    optimizer: Any
    scheduler: Any
    dist: DistConfig = field(default_factory=DistConfig)
    seed: int = MISSING  # MISSING: the top-level keys' values are conf/config.yaml's
    resume: str | None = MISSING
    init_from: str | None = None  # fine-tune: a fresh run from the MODEL WEIGHTS of this file (a checkpoint of
    # this template, a torch.save'd state_dict or a .safetensors file); a run dir's checkpoint (resume=auto) wins
    init_from_strict: bool = True  # false: load the weights that match, keep a fresh initialisation for the rest
    trusted_targets: list[str] = MISSING
    print_config: bool = False  # also print the composed config to the console (it is always in the log files)
    aux: Any = MISSING  # frozen auxiliary models by name (src/loop/task_and_model.py)
    callbacks: Any = field(default_factory=dict)  # the add-ons around the loop, by name (conf/callbacks/)
    logger: Any = field(default_factory=dict)  # where the run's scalars go, by name (conf/logger/)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


OPEN_GROUP_RULES: dict[str, Rule] = {
    "optimizer.lr": number_or_null(zero_allowed=True),  # lr=0 freezes the weights; absent: the optimizer has none
    "scheduler.warmup_epochs": number_or_null(zero_allowed=True),  # absent (null): the schedule has none
    "scheduler.step_epochs": number_or_null(zero_allowed=False),  # 0 would decay the LR at every step
    "scheduler.gamma": number_or_null(zero_allowed=False),  # 0 would stop training at the first decay
    "dataset.batch_size": number_or_null(False, whole=True),  # the global batch; null: src/data/loaders.py refuses it
    "dataset.num_workers": number_or_null(True, whole=True),  # absent (null): 0, the loading in the main process
    "dataset.val_batch_size": number_or_null(False, whole=True),  # null: dataset.batch_size
}


# -- eval.py's settings: the same declarations, for the keys it shares ---------------------------------


@dataclass
class EvalTrainerConfig:
    precision: Any = precision_setting(None)  # null: the checkpoint's trainer.precision | 32 | bf16 | 16
    device: str = setting("auto", one_of(*DEVICES))  # auto: cuda:LOCAL_RANK if a GPU is visible, else cpu | cpu | cuda


@dataclass
class EvalDistConfig:
    """eval.py's `dist` keys: the process group under torchrun."""

    backend: str = setting("auto", one_of(*BACKENDS))  # auto: nccl on GPUs, gloo on CPU | nccl | gloo
    timeout_s: float = setting(1800.0, number_or_null(zero_allowed=False))  # seconds a collective may wait


@dataclass
class EvalSchema:
    checkpoint: str
    trusted_targets: list[str]
    dataset: Any
    weights: str = setting("model", one_of("model", "ema"))  # the checkpoint's weights or its EMA weights
    split: str | None = setting(None, one_of("val", "test", or_null=True))  # null: test where there is one
    trainer: EvalTrainerConfig = field(default_factory=EvalTrainerConfig)
    dist: EvalDistConfig = field(default_factory=EvalDistConfig)


# Registered on import, before Hydra composes: the defaults lists name these entries.
ConfigStore.instance().store(name="train_schema", node=TrainSchema)
ConfigStore.instance().store(name="eval_schema", node=EvalSchema)


def check_train_config(cfg: DictConfig) -> None:
    """Refuse values the schema's types let through, naming every key to change at once."""
    missing = OmegaConf.missing_keys(cfg)
    problems = [f"{key} is required: add {key}=VALUE" for key in sorted(missing)]
    init_from, resume = OmegaConf.select(cfg, "init_from"), OmegaConf.select(cfg, "resume")
    if init_from is not None and resume not in (None, "auto"):  # a fresh run, or another run's state: not both
        problems.append(f"init_from={init_from} starts a fresh run from weights, resume={resume} continues a run: pass "
                        "only one (with resume=auto, init_from applies only when the run dir holds no checkpoint yet)")
    rules = {**rules_of("trainer", TrainerConfig), **rules_of("dist", DistConfig), **OPEN_GROUP_RULES}
    if problems := problems + [*added_settings(cfg, TrainSchema)] + value_problems(cfg, rules, skip=missing):
        raise UsageError("; ".join(problems))


def check_eval_config(cfg: DictConfig) -> None:
    """eval.py's `check_train_config`, for the keys it shares (its `checkpoint` it checks itself)."""
    rules = {**rules_of("", EvalSchema), **OPEN_GROUP_RULES}  # and dataset.*
    if problems := [*added_settings(cfg, EvalSchema)] + value_problems(cfg, rules):
        raise UsageError("; ".join(problems))


def added_settings(node: DictConfig, settings: type, prefix: str = "") -> Iterator[str]:
    """What is wrong with each key a `+` added to a block the schema declares (the root, `trainer`, `dist`)."""
    declared = {f.name: f.default_factory for f in fields(settings)}
    for key in map(str, node):
        if is_dataclass(declared.get(key)):
            yield from added_settings(node[key], declared[key], f"{prefix}{key}.")
        elif key not in declared:
            yield f"{prefix}{key} is not a setting{did_you_mean(key, declared, prefix)}: nothing reads it; remove it"


def rules_of(prefix: str, settings: type) -> dict[str, Rule]:
    """`prefix.KEY` -> the rule of each field of `settings` (and of nested settings) that has one."""
    rules: dict[str, Rule] = {}
    for f in fields(settings):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if "rule" in f.metadata:
            rules[key] = f.metadata["rule"]
        elif is_dataclass(f.default_factory):
            rules.update(rules_of(key, f.default_factory))
    return rules


def value_problems(cfg: DictConfig, rules: dict[str, Rule], skip: set[str] = frozenset()) -> list[str]:
    """`KEY=VALUE what is wrong` for each key whose value breaks its rule (keys in `skip` are not read)."""
    values = {key: OmegaConf.select(cfg, key) for key in rules if key not in skip}
    return [f"{key}={value} {problem}" for key, value in values.items() if (problem := rules[key](value))]


class CheckBeforeWriting(Callback):
    """Refuse a bad value, or a fresh run into a run dir that holds one, before Hydra writes `.hydra/` there."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        HydraConfig.instance().set_config(config)  # as Hydra does as the job starts: errors name the options chosen
        with exit_on_usage_error(is_main_process()):  # Hydra makes a callback's exception a warning; not SystemExit
            check_train_config(OmegaConf.masked_copy(config, [key for key in config if key != "hydra"]))
            check_run_dir(Path(config.hydra.run.dir))  # one set on the command line (a default one: fresh_dir's)
            if is_main_process():  # a late rank could see the checkpoint rank 0 has just written
                layout.resume_path(Path(config.hydra.run.dir) / "checkpoints", resume_setting(config.resume))
