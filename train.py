"""Train a model on a task, on one process or as one worker of a DDP group.

    python train.py                                   # one process (CPU or one GPU)
    torchrun --nproc_per_node=2 train.py model=cnn    # a DDP group of 2 workers
    python train.py dist.nproc_per_node=2             # the same group, started from here
    python train.py --help                            # config groups and options

The story of a run: compose the config (Hydra), join the process group, build the
data, the task, the callbacks and the model, the optimizer and schedule, resume if asked,
train, report. Each step is one call into `src/`.
"""

from __future__ import annotations

from src.common import errors  # torch- and Hydra-free: checked before the imports below

if __name__ == "__main__":
    # A restart after a usage error would only stop on it again: exit before paying for Hydra's imports.
    errors.exit_if_failed_for_good()

import json
import logging
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from src import checkpoint
from src.common import heap, lazy
from src.config import building, data_fields, hydra_errors, schema, trusted_targets
from src.parallel import launch, ranks
from src.parallel.launch import RunContext
from src.reports.hparams import run_hparams

# The run's own modules: torch and everything built on it (~3 s), imported where the run begins, so that
# `--help` and `--cfg job` answer without them (src/common/lazy.py).
distributed = lazy.module("src.parallel.distributed")
fsdp = lazy.module("src.parallel.fsdp")
workers = lazy.module("src.parallel.workers", with_the_run=False)  # a launcher's and its workers' only
seeding = lazy.module("src.common.seeding")
loaders = lazy.module("src.data.loaders")
resume = lazy.module("src.checkpoint.resume")
callback = lazy.module("src.loop.callback")
init_from = lazy.module("src.loop.init_from")
models = lazy.module("src.loop.models")
performance = lazy.module("src.loop.performance")
setup = lazy.module("src.loop.setup")
trainer = lazy.module("src.loop.trainer")
reporting = lazy.module("src.reports.reporting")
tracking = lazy.module("src.reports.tracking")

log = logging.getLogger("train")

launch.register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Hydra's entry point; returns the final value of the monitored metric (what sweepers optimise)."""
    hydra_errors.config_composed()  # from here on, errors are the run's (Hydra reports them as usual)
    ranks.adopt_cluster_env()  # submitit / SLURM tasks become torchrun-style workers
    context = RunContext.of(HydraConfig.get())
    with errors.exit_on_usage_error(ranks.is_main_process(), context.in_sweep), \
            launch.discard_unused_run_dir(context.run_dir, context.created, context.in_sweep):
        schema.check_train_config(cfg)  # values the schema's types cannot refuse, before any work
        if cfg.dist.nproc_per_node > 1 and not ranks.is_worker():
            heap.resume_collection()  # this process only waits on its workers, for as long as they run
            workers.launch_workers(__file__, cfg.dist.nproc_per_node, context.run_dir, context.overrides,
                                   cfg.dist.master_port, cfg.trainer.device, cfg.dist.backend, context.composing)
            return workers_result(context.run_dir / "metrics.json", cfg.trainer.monitor)
        return (workers.recording_errors(train) if ranks.is_worker() else train)(cfg, context)


def workers_result(metrics_file: Path, monitor: str | None) -> float:
    """What the launcher returns: the workers' last monitored value; NaN if they stopped (max_steps, preemption)
    before the first validation wrote metrics.json, as a one-process run returns."""
    return json.loads(metrics_file.read_text()).get(monitor, float("nan")) if metrics_file.exists() and monitor \
        else float("nan")


def train(cfg: DictConfig, context: RunContext) -> float:
    """Join the process group, run, leave it."""
    # Start-up's objects (the run's modules included) are frozen; what the run builds, the process group
    # first, is collected as usual.
    lazy.load_all()
    heap.resume_collection()
    with errors.out_of_memory_is_one_line(cfg.dist.strategy), \
            distributed.process_group(cfg.trainer.device, cfg.dist.backend, cfg.dist.timeout_s,
                                      cfg.dist.step_timeout_s) as runtime:
        # The run's objects (DDP's reducer among them) are freed when run() returns, before
        # the group they talk through is destroyed.
        return run(cfg, context, runtime)


def run(cfg: DictConfig, context: RunContext, runtime: Any) -> float:
    reporting.setup_logging(context.run_dir, runtime.env.rank)
    trackers = build_trackers(cfg.logger, context, runtime.is_main_process)  # a missing package: one line, here
    trainer_cfg: schema.TrainerConfig = OmegaConf.to_object(cfg.trainer)  # the `trainer` settings, typed
    # A background write's collectives are a rank's write apart, a gap dist.step_timeout_s covers by definition.
    writer_timeout_s = cfg.dist.timeout_s if cfg.dist.step_timeout_s is None else cfg.dist.step_timeout_s
    store = checkpoint.open_store(cfg.dist.strategy, context.run_dir / "checkpoints", runtime.is_main_process,
                                  trainer_cfg.keep_last, trainer_cfg.async_checkpoint, writer_timeout_s)
    # A restarted or requeued run picks up where it stopped; otherwise as configured. Every rank gets
    # the same checkpoint (with auto: the newest that loads), or the run stops here, before any work.
    resumed = resume.load_resume_checkpoint(store.directory, runtime.is_main_process, launch.resume_setting(cfg.resume),
                                            trusted_targets.trusted(cfg.trusted_targets, cfg))

    seeding.seed_everything(cfg.seed)  # the same initial weights on every rank
    with building.errors_named("dataset", cfg.dataset, passed_elsewhere=loaders.LOADER_KEYS):
        data = loaders.build_data(cfg.dataset, runtime.env.rank, runtime.world_size, runtime.device, cfg.seed,
                                  trainer_cfg)
    callbacks = build_callbacks(cfg.callbacks, trackers)
    # The task must fit the dataset, produce the monitored metric (the callbacks add metrics, e.g. val_ema/*) and
    # find its inputs and target among the dataset's fields.
    with building.errors_named("task", cfg.task):
        task = setup.build_task(cfg.task, data.splits, context.choices, trainer_cfg.monitor,
                                callbacks.metric_splits, callbacks.enable_hints())
    # What the task's output check names, read before the model config's fields are filled in.
    task.output_setting = setup.output_setting(cfg.model, context.overrides)
    saved_config = fill_model_config(cfg, setup.model_fields(task, data.splits.info), context.choices["dataset"])
    parts = build_parts(cfg, trainer_cfg, context, runtime, data, task, callbacks, store, saved_config, resumed)
    return train_and_report(trainer_cfg, parts, resumed, context, cfg.print_config)


def build_trackers(logger_cfg: DictConfig, context: RunContext, is_main_process: bool) -> Any:
    """The experiment trackers `logger` names besides TensorBoard (conf/logger/), built by rank 0 alone: a
    package that is missing or a server that does not answer is one line here, before any work."""
    built = {}
    for name, node in logger_cfg.items():
        if is_main_process and name != "tensorboard":  # TensorBoard is the Reporter's own
            with building.errors_named(f"logger.{name}", node):
                built[str(name)] = instantiate(node)
    return tracking.Trackers(built, tracking.identity_of(context.run_dir, context.in_sweep), context.overrides,
                             context.choices)


def build_callbacks(callbacks_cfg: DictConfig, trackers: Any) -> Any:
    """The run's callbacks (conf/callbacks/), built in config order, after the trackers (told first of a
    failure, before a callback may raise a clearer error); a setting one refuses is one line."""
    built = {"trackers": trackers}
    for name, node in callbacks_cfg.items():
        with building.errors_named(f"callbacks.{name}", node):
            built[str(name)] = instantiate(node)
    return callback.Callbacks(built)


def fill_model_config(cfg: DictConfig, fields: dict[str, Any], dataset: str) -> dict[str, Any]:
    """Write what the dataset and task provide into the model config's `${data:FIELD}`s (so `cfg.model` builds
    the model anywhere from now on), and return the run's resolved config as checkpoints save it: with the
    fields the model takes, which eval.py checks its data against."""
    used = data_fields.used_by(cfg.model, fields)
    filled = data_fields.fill(cfg.model, fields, f"dataset={dataset}")
    with open_dict(cfg):
        cfg.model = filled
    return {**OmegaConf.to_container(cfg, resolve=True), "data_fields": used}


def build_parts(cfg, trainer_cfg, context, runtime, data, task, callbacks, store, saved_config,  # noqa: ANN001
                resumed) -> Any:  # noqa: ANN001
    """What the loop needs once the data and task are known: the models (each wrapped for DDP, or sharded, and
    compiled) with their optimizers and schedules, the task's auxiliary models, the reporter (a TrainParts)."""
    performance.set_backend_flags(runtime.device, trainer_cfg.tf32, trainer_cfg.deterministic)
    task.aux = models.build_aux(cfg.aux, task, runtime.device, trusted_targets.trusted(cfg.trusted_targets, cfg))
    modules, train_models = models.build_trained(cfg, trainer_cfg, task, runtime)
    starting_weights(cfg, modules, task.output_model, resumed)
    optimizers, schedulers = models.build_optimizers(cfg, modules, data.train_sampler.steps_per_epoch,
                                                     trainer_cfg.epochs)
    reporter = reporting.Reporter(context.run_dir, runtime.is_main_process, "tensorboard" in cfg.logger,
                                  trainer_cfg.progress, callbacks.all["trackers"])
    return trainer.TrainParts(runtime, task, modules, train_models, optimizers, schedulers, data, store, reporter,
                              callbacks, seed=cfg.seed, saved_config=saved_config)


def starting_weights(cfg: DictConfig, modules: dict[str, Any], output_model: str, resumed: Any) -> None:
    """`init_from`'s weights (weights only: the optimizer, schedule and step count start afresh) over the models'
    own on a fresh start; a resumed run's are read later, into the same modules. Weights that do not fit are
    refused before the run writes anything."""
    if resumed is not None and cfg.init_from is not None:
        log.info("init_from=%s not applied: the run resumes from %s", cfg.init_from, resumed.path)
    elif cfg.init_from is not None:
        init_from.load_on_every_rank(modules, output_model, Path(cfg.init_from), cfg.init_from_strict)


def train_and_report(trainer_cfg, parts, resumed, context: RunContext, print_config: bool) -> float:  # noqa: ANN001
    """Train (from the resumed state, if any), then report; returns the last monitored value."""
    loop = trainer.Trainer(trainer_cfg, parts)
    state = trainer.TrainState()
    if resumed is not None:  # every part but the callbacks', before the run writes anything
        loop.restore(state, resumed)
    reporting.log_run_start(context.run_dir, parts.runtime, parts.modules, parts.data, trainer_cfg.grad_accum,
                            parts.saved_config, context.overrides, print_config, parts.task.unit)
    parts.reporter.text("model/summary", reporting.model_summary(parts.modules))
    if not loop.fit(state, resumed).is_final:  # max_steps or preemption, with a checkpoint
        log.info("stopped at step %d with a checkpoint; continue with: resume=auto hydra.run.dir=%s",
                 state.step, context.run_dir)
        parts.reporter.close()  # the trackers' runs KILLED until the run continues
        return monitored(state.history[-1] if state.history else {}, trainer_cfg.monitor)
    return report_final(loop, state, context)


def monitored(record: dict[str, Any], monitor: str | None) -> float:
    """The monitored value of an epoch's record: NaN without one (no epoch yet, or trainer.monitor=null)."""
    return record.get(monitor, float("nan")) if monitor is not None else float("nan")


def report_final(loop, state, context: RunContext) -> float:  # noqa: ANN001 - Trainer, TrainState
    """The finished run's hparams and final metrics; returns the monitored one."""
    parts = loop.parts
    summary = loop.summary(state, parts.data.num_val_samples)
    final = {k: v for k, v in summary.items() if "/" in k and "/num_" not in k}
    hparams = run_hparams(parts.saved_config, context.overrides, context.choices,
                          parts.data.train_sampler.global_batch_size)
    parts.reporter.hparams(hparams, final)
    parts.reporter.close()
    log.info("final: %s", "  ".join(f"{k}={v:.4f}" for k, v in final.items()))
    log.info("run dir: %s", context.run_dir)
    return monitored(summary, loop.config.monitor)


if __name__ == "__main__":
    launch.die_with_launcher()  # a worker of dist.nproc_per_node ends with the process that started it
    heap.pause_collection()  # resumed in train(), once the imports are done
    with hydra_errors.one_line_config_errors(ranks.is_main_process(), "config"):
        main()
    # A worker that ran a DDP group skips the interpreter's teardown, which the group's threads could
    # abort (src/parallel/distributed.py). Only here, after every job: errors exit as usual above.
    if ranks.is_worker():
        distributed.exit_after_a_group()
