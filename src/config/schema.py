"""Every `trainer` and `dist` setting, declared once; what a valid config is; and one line telling the
user what to change when it is not.

Each setting of train.py's `trainer` block and `dist` group is one field below: its name, type,
default, meaning (the comment beside it) and, where the type lets more through than the setting
takes, the rule its value must pass (the field's metadata). The YAML files do not repeat them:
conf/config.yaml names `train_schema` first in its defaults list, so these defaults are the config's
and the YAML files and presets (conf/experiment/, conf/debug/) only override them. eval.py's config
reuses the same field declarations for the few keys it shares. The loop, the data loaders and train.py
read the typed objects (`OmegaConf.to_object(cfg.trainer)` is a `TrainerConfig`).

Three layers check a config, each catching what the one before cannot:

1. Types, at compose time. The dataclasses are registered in Hydra's ConfigStore (Hydra's
   "structured config schema" pattern), so `trainer.epochs=abc` or `dist.sync_bn=maybe` fails
   before anything runs.
2. Hydra's compose errors (unknown option, unknown key, wrong type, unparsable override) are
   multi-line reports; `src/config/hydra_errors.py` turns each into one `error:` line and exit code 2.
3. Values types cannot express (`trainer.epochs=0`, a negative learning rate) are refused by
   `check_train_config` / `check_eval_config` when the run starts, before any work, from the rules
   in the fields' metadata. Nothing else checks them again.

The groups whose options name a `_target_` (model, dataset, optimizer, scheduler) stay open: each
option has its own keys (SGD's momentum, Adam's betas), a dataclass node refuses keys it does not
declare, and "add a model = one class + one YAML" should not grow a third file. Their keys are
still closed to typos (Hydra's struct mode), and the few values that matter have a rule in
`OPEN_GROUP_RULES`.

Nothing here imports torch: `python train.py --help` and `--cfg job` stay fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable

from hydra.core.config_store import ConfigStore
from hydra.experimental.callback import Callback
from omegaconf import MISSING, DictConfig, OmegaConf

from src.checkpoint import layout
from src.common.errors import UsageError, exit_on_usage_error
from src.parallel.ranks import resume_setting
from src.parallel.ranks import is_main_process

# -- rules: what a value may be, beyond its type ----------------------------------------------------

Rule = Callable[[Any], str | None]  # a value -> what is wrong with it, or None


def one_of(*allowed: str, or_null: bool = False) -> Rule:
    def rule(value: Any) -> str | None:
        if (value is None and or_null) or (value is not None and str(value) in allowed):
            return None
        return f"is not one of {', '.join(allowed)}" + (" (or null)" if or_null else "")

    return rule


def at_least(minimum: int, or_null: bool = False) -> Rule:
    def rule(value: Any) -> str | None:
        if (value is None and or_null) or (value is not None and value >= minimum):
            return None
        return f"must be at least {minimum}" + (" (or null)" if or_null else "")

    return rule


def number_or_null(zero_allowed: bool) -> Rule:
    def rule(value: Any) -> str | None:
        # Also a type check: optimizer.lr lives in an open group, so `optimizer.lr=abc` gets this far.
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value is None or (is_number and (value >= 0 if zero_allowed else value > 0)):
            return None
        return "must be a number >= 0" if zero_allowed else "must be a positive number"

    return rule


def fraction_or_null(value: Any) -> str | None:
    """A number strictly between 0 and 1, or null."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return None if value is None or (is_number and 0 < value < 1) else "must be in (0, 1) (or null)"


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
    """`trainer.precision`: 32 | bf16 | 16 (fp16 autocast with gradient scaling; for GPUs). Typed Any:
    a str node would turn 32 into "32". A null default (eval.py) means "the checkpoint's", and null is
    then allowed."""
    return setting(default, one_of(*PRECISIONS, or_null=default is None))


def device_setting() -> Any:
    """`trainer.device`: auto (cuda:LOCAL_RANK if a GPU is visible, else cpu) | cpu | cuda."""
    return setting("auto", one_of(*DEVICES))


def backend_setting() -> Any:
    """`dist.backend`: auto (nccl on GPUs, gloo on CPU) | nccl | gloo."""
    return setting("auto", one_of(*BACKENDS))


def timeout_setting() -> Any:
    """`dist.timeout_s`: seconds a collective may wait for the other ranks before failing."""
    return setting(1800.0, number_or_null(zero_allowed=False))


# -- train.py's settings --------------------------------------------------------------------------


@dataclass
class TrainerConfig:
    """The `trainer` block: how the loop trains, checkpoints and reports. `train.py trainer.KEY=VALUE`
    sets one. Built directly (tests), `monitor`/`monitor_mode` stay the interpolations below: pass them."""

    epochs: int = setting(20, at_least(1))  # passes over the training set
    precision: Any = precision_setting(32)  # 32 | bf16 | 16 (fp16 autocast with gradient scaling; for GPUs)
    grad_accum: int = setting(1, at_least(1))  # micro-steps per optimizer step; dataset.batch_size stays the
    # global batch per step
    grad_clip: float | None = setting(None, number_or_null(zero_allowed=False))  # clip the global gradient L2
    # norm to this value; null = no clipping
    compile: bool = False  # wrap the model in torch.compile (TorchInductor: builds kernels with the system C++
    # compiler, ~30 s at a run's start on a CPU, cached for the next; pays off on GPUs)
    log_every_steps: int = setting(50, at_least(1))  # optimizer steps between TensorBoard train/* scalars
    # (SIGTERM/SIGUSR2 are also checked here and every ~2 s between log steps: src/parallel/preemption.py)
    device: str = device_setting()  # auto: cuda:LOCAL_RANK if a GPU is visible, else cpu | cpu | cuda
    save_checkpoints: bool = True  # write checkpoints/last.pt every epoch and best.pt on improvement
    monitor: str | None = "${task.monitor}"  # metric that decides best.pt, what train.py returns and sweeps sort
    # by: val/<name> or train/<name> for a name the task computes; default: the task's; null: no best.pt (a
    # method with no metric that means "better", e.g. a GAN without a judge)
    monitor_mode: str = setting("${task.mode}", one_of("max", "min"))  # max | min: whether a larger or a
    # smaller monitor value is better; default: the task's
    test: bool = True  # when training ends (its last epoch, trainer.max_steps, or a callback's stop; not a
    # preemption), evaluate the chosen weights (best.pt's, or the last ones when nothing is monitored; EMA's too) once
    # on the dataset's test split: test/* in metrics.json, the log, TensorBoard and the trackers. false: no test
    checkpoint_every_steps: int | None = setting(None, at_least(1, or_null=True))  # also checkpoint mid-epoch
    # every N optimizer steps (null: at epoch ends only); resume goes on from that very step with the same
    # remaining data
    async_checkpoint: bool = False  # true: a save waits only for a copy of the state in host memory and is written
    # in the background while training goes on (at most one in flight; the next save and the run's end wait).
    # The host copy is kept between saves (one more copy of each rank's state in RAM), and later saves copy into it
    keep_last: int = setting(2, at_least(1))  # newest mid-epoch checkpoints kept as checkpoints/step_<N>.pt
    # (last.pt is always kept)
    max_steps: int | None = setting(None, at_least(1, or_null=True))  # stop after this many optimizer steps in
    # all, with a checkpoint (e.g. to fit a time limit; continue later with resume=auto); null: all epochs
    limit_train_batches: int | None = setting(None, at_least(1, or_null=True))  # at most this many optimizer
    # steps per epoch (null: the whole train split)
    limit_val_batches: int | None = setting(None, at_least(1, or_null=True))  # at most this many val batches
    # per rank (null: the whole val split)
    overfit_batches: int = setting(0, at_least(0))  # >0: train AND validate on the same first N global
    # batches of the train split, to check that the model can drive the loss to ~0 (0: off)
    progress: bool = True  # rank-0 progress bars for train and val (shown only when stdout is a terminal)
    channels_last: bool = False  # NHWC memory format for the model and images (faster convolutions on recent
    # GPUs)
    tf32: bool = True  # allow TensorFloat-32 matmuls/convolutions on Ampere+ GPUs (no effect on CPU)
    deterministic: bool = False  # deterministic cuDNN algorithms; false lets cudnn.benchmark pick the fastest
    freeze: list[str] = field(default_factory=list)  # parameter-name prefixes (e.g. [features]) whose parameters
    # get no gradient and no optimizer state: linear probing / partial fine-tuning (a prefix matching no
    # parameter is an error). BatchNorm running statistics of frozen layers still update while training


STRATEGIES = ("ddp", "fsdp")  # a full copy of the model per rank | the model sharded over the ranks (FSDP2)


@dataclass
class FsdpConfig:
    """`dist.fsdp`: how `dist.strategy=fsdp` shards the model (src/parallel/fsdp.py). Each wrapped module's
    parameters are one flat shard per rank, gathered for its forward and backward and freed after."""

    wrap: list[str] = field(default_factory=list)  # class names of the modules sharded as units (e.g.
    # [BasicBlock], [Linear]), then the root; []: auto, the root's children that hold at least min_unit_params
    # parameters (the children of a lone container child, e.g. an MLP's Sequential); [root]: the whole model as
    # one unit (fewest collectives: the fastest for small models, but all parameters gathered at once)
    min_unit_params: int = setting(1_000_000, at_least(0))  # with wrap=[]: a child smaller than this is no unit
    # of its own (its parameters go with the root's): each unit costs an all-gather in the forward, another in
    # the backward and a reduce-scatter, which a small unit's memory does not repay. 0: every child that holds
    # parameters. The digits CNN (151k parameters) is then one unit: 0.92x DDP's throughput, 0.70x as two
    reshard_after_forward: bool = True  # free the gathered parameters after each unit's forward and gather
    # them again for its backward (least memory); false keeps them to the backward (one all-gather less).
    # The root keeps its own gathered either way: its backward comes first
    cpu_offload: bool = False  # keep the parameter shards, their gradients and the optimizer state in host
    # memory, copied to the GPU for each unit's compute (fits larger models; slower; GPUs only: refused on the CPU)


@dataclass
class DistConfig:
    """The `dist` group: data-parallel training, used when the launcher starts more than one process
    (torchrun sets RANK / LOCAL_RANK / WORLD_SIZE); a single process ignores these keys except `strategy`
    (its checkpoint format). conf/dist/ddp.yaml takes these defaults; conf/dist/fsdp.yaml sets strategy=fsdp."""

    strategy: str = setting("ddp", one_of(*STRATEGIES))  # ddp: DistributedDataParallel, every rank holds the
    # whole model, gradients and optimizer state, checkpoints are one .pt by rank 0 | fsdp: FSDP2, each rank
    # holds 1/world_size of them, checkpoints are sharded directories (torch.distributed.checkpoint)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)  # dist.fsdp.wrap, reshard_after_forward,
    # cpu_offload: declared in FsdpConfig above (used with strategy=fsdp)
    backend: str = backend_setting()  # auto: nccl on GPUs, gloo on CPU | nccl | gloo
    sync_bn: bool = True  # BatchNorm statistics over the global batch (nn.SyncBatchNorm on GPUs,
    # src/parallel/sync_batchnorm.py on CPU); false = per-rank statistics
    find_unused_parameters: bool = False  # set true if some parameters get no gradient in a step (slower)
    timeout_s: float = timeout_setting()  # seconds a collective may wait for the other ranks until this
    # rank's first optimizer step: start-up may hold ranks apart for long (rendezvous, rank 0 downloading the
    # dataset, torch.compile), and failing it wastes the whole wait
    step_timeout_s: float | None = setting(300.0, number_or_null(zero_allowed=False))  # seconds after the
    # first step: a frozen or hung rank stops the group this soon (then `timeout: ... rank(s) N did not arrive`
    # in the log). It must exceed the longest gap between collectives: a step, rank 0 writing a checkpoint,
    # an eval pass. null: keep timeout_s all run
    nproc_per_node: int = setting(1, at_least(1))  # >1: `python train.py` itself starts this many local
    # workers as one DDP group (torch's elastic launcher, like torchrun --standalone); ignored under torchrun
    master_port: int | None = setting(None, port_or_null)  # with nproc_per_node>1: the rendezvous port on
    # localhost (null: a free port the OS picks, so several runs on one machine never collide)


@dataclass
class TrainSchema:
    """conf/config.yaml: train.py's config (the top-level keys' meanings are commented there)."""

    task: Any
    model: Any
    dataset: Any
    optimizer: Any
    scheduler: Any
    dist: DistConfig = field(default_factory=DistConfig)
    seed: int = MISSING  # MISSING: the top-level keys' values are conf/config.yaml's
    resume: str | None = MISSING
    init_from: str | None = None  # fine-tune: a fresh run (new optimizer, schedule and step count) that starts
    # from the MODEL WEIGHTS of this file: a checkpoint of this template (each model from its model of the same
    # name), a state_dict saved with torch.save, or a .safetensors file (the output model's). Only for a fresh
    # start: with resume=auto and a checkpoint in the run dir the run resumes instead; with resume=PATH it is
    # refused
    init_from_strict: bool = True  # true: every key and shape must match the model, else one error line.
    # false: load the weights that match, keep a fresh initialisation for the rest (listed in the log):
    # the way to say "re-initialise the head" when the class count differs
    trusted_targets: list[str] = MISSING
    print_config: bool = False  # also print the composed config to the console at the start (it is always in
    # .hydra/config.yaml and in each rank's log file, resolved as the rank trains with it)
    aux: Any = MISSING  # frozen auxiliary models by name (conf/config.yaml; src/loop/task_and_model.py)
    callbacks: Any = field(default_factory=dict)  # the add-ons around the loop, by name (conf/callbacks/)
    logger: Any = field(default_factory=dict)  # where the run's scalars go, by name (conf/logger/): tensorboard,
    # mlflow, wandb, csv; several at once with logger=[tensorboard,mlflow]
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# Values in the open groups (see the module's docstring) that the run depends on.
OPEN_GROUP_RULES: dict[str, Rule] = {
    "optimizer.lr": number_or_null(zero_allowed=True),  # lr=0 freezes the weights; absent: the optimizer has none
}


# -- eval.py's settings: the same declarations, for the keys it shares ---------------------------------


@dataclass
class EvalTrainerConfig:
    """eval.py's `trainer` keys: what may differ from the run that saved the checkpoint."""

    precision: Any = precision_setting(None)  # null: the checkpoint's trainer.precision | 32 | bf16 | 16
    device: str = device_setting()  # auto: cuda:LOCAL_RANK if a GPU is visible, else cpu | cpu | cuda


@dataclass
class EvalDistConfig:
    """The process group under torchrun (one process needs none). Evaluation syncs no gradients, so the
    training-only keys of DistConfig (sync_bn, nproc_per_node, ...) do not apply."""

    backend: str = backend_setting()  # auto: nccl on GPUs, gloo on CPU | nccl | gloo
    timeout_s: float = timeout_setting()  # seconds a collective may wait for the other ranks before failing


@dataclass
class EvalSchema:
    """conf/eval.yaml: eval.py's config."""

    checkpoint: str
    trusted_targets: list[str]
    dataset: Any
    weights: str = setting("model", one_of("model", "ema"))  # which weights of the checkpoint to evaluate:
    # model | ema (its EMA weights: a run with callbacks.ema.decay set)
    split: str | None = setting(None, one_of("val", "test", or_null=True))  # the split evaluated: val | test;
    # null: test where the dataset has one, else val
    trainer: EvalTrainerConfig = field(default_factory=EvalTrainerConfig)
    dist: EvalDistConfig = field(default_factory=EvalDistConfig)


# Registered on import, as Hydra's docs do: train.py and eval.py import this module before Hydra
# composes, and the defaults lists name these entries.
ConfigStore.instance().store(name="train_schema", node=TrainSchema)
ConfigStore.instance().store(name="eval_schema", node=EvalSchema)


# -- layer 3: values ------------------------------------------------------------------------------


def check_train_config(cfg: DictConfig) -> None:
    """Refuse values the schema's types let through, naming every key to change at once."""
    missing = OmegaConf.missing_keys(cfg)
    problems = [f"{key} is required: add {key}=VALUE" for key in sorted(missing)]
    rules = {**rules_of("trainer", TrainerConfig), **rules_of("dist", DistConfig), **OPEN_GROUP_RULES}
    problems += init_from_problems(cfg)
    _refuse(problems + value_problems(cfg, rules, skip=missing))


def init_from_problems(cfg: DictConfig) -> list[str]:
    """init_from starts a fresh run; resuming a given checkpoint is another run's state: not both."""
    init_from, resume = OmegaConf.select(cfg, "init_from"), OmegaConf.select(cfg, "resume")
    if init_from is not None and resume not in (None, "auto"):
        return [f"init_from={init_from} starts a fresh run from weights, resume={resume} continues a run: pass only "
                "one (with resume=auto, init_from applies only when the run dir holds no checkpoint yet)"]
    return []


def check_eval_config(cfg: DictConfig) -> None:
    """eval.py's `check_train_config`, for the keys it shares (its `checkpoint` it checks itself)."""
    _refuse(value_problems(cfg, rules_of("", EvalSchema)))  # trainer.*, dist.* and weights


def rules_of(prefix: str, settings: type) -> dict[str, Rule]:
    """`prefix.KEY` -> the rule of each field of `settings` that has one, and of the fields of nested
    settings (`trainer.fsdp.min_unit_params`); with an empty prefix, `KEY`."""
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
    problems = []
    for key, rule in rules.items():
        value = None if key in skip else OmegaConf.select(cfg, key)
        problem = None if key in skip else rule(value)
        if problem:
            problems.append(f"{key}={value} {problem}")
    return problems


def _refuse(problems: list[str]) -> None:
    if problems:
        raise UsageError("; ".join(problems))


class CheckBeforeWriting(Callback):
    """Refuse a bad value, or a fresh run into a run dir that already holds one, before Hydra
    writes `.hydra/` into the run dir: Hydra does that before the task function starts, so a
    check there would already have overwritten an existing run's saved config."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Hydra turns a callback's exception into a warning and goes on; SystemExit it lets through.
        with exit_on_usage_error(is_main_process()):
            check_train_config(OmegaConf.masked_copy(config, [key for key in config if key != "hydra"]))
            if is_main_process():  # a late rank could see the checkpoint rank 0 has just written
                checkpoints = Path(config.hydra.run.dir) / "checkpoints"
                layout.resume_path(checkpoints, resume_setting(config.resume))
