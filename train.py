"""Train a model on a task, on one process or as one worker of a DDP group.

    python train.py                                   # one process (CPU or one GPU)
    torchrun --nproc_per_node=2 train.py model=cnn    # a DDP group of 2 workers
    python train.py dist.nproc_per_node=2             # the same group, started from here
    python train.py --help                            # config groups and options

The story of a run: compose the config (Hydra), join the process group, build the
data, the task and the model, the optimizer and schedule, resume if asked, train, report.
Each step is one call into `src/`.
"""

from __future__ import annotations

from src.parallel import retries  # torch- and Hydra-free: checked before the imports below

if __name__ == "__main__":
    # A restart after a usage error would only stop on it again: exit before paying for Hydra's imports.
    retries.exit_if_failed_for_good()

import json
import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from src.common import heap
from src.common.errors import exit_on_usage_error
from src.config import data_fields, hydra_errors, schema
from src.parallel import launch

log = logging.getLogger("train")

launch.register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Hydra's entry point; returns the final value of the monitored metric (what sweepers optimise)."""
    # torch and everything built on it load inside train(), not at the top: `--help` and
    # `--cfg job` answer without paying seconds for imports they do not use.
    hydra_errors.config_composed()  # from here on, errors are the run's (Hydra reports them as usual)
    launch.adopt_cluster_env()  # submitit / SLURM tasks become torchrun-style workers
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
    with exit_on_usage_error(launch.is_main_process(), in_sweep), launch.discard_unused_run_dir(run_dir, in_sweep):
        schema.check_train_config(cfg)  # values the schema's types cannot refuse, before any work
        if cfg.dist.nproc_per_node > 1 and not launch.is_worker():
            heap.resume_collection()  # this process only waits on its workers, for as long as they run
            launch.launch_workers(__file__, cfg.dist.nproc_per_node, run_dir, hydra_cfg.overrides.task,
                                  cfg.dist.master_port, cfg.trainer.device, cfg.dist.backend)
            return json.loads((run_dir / "metrics.json").read_text())[cfg.trainer.monitor]
        return launch.recording_errors(train)(cfg, run_dir, hydra_cfg.runtime.choices)


def train(cfg: DictConfig, run_dir: Path, choices: dict[str, str]) -> float:
    """Join the process group, run, leave it. `choices`: the option Hydra chose in each group."""
    from src.parallel import distributed

    # Start-up's objects are frozen; what the run builds, the process group first, is collected as usual.
    heap.resume_collection()
    with distributed.process_group(cfg.trainer.device, cfg.dist.backend, cfg.dist.timeout_s,
                                   cfg.dist.step_timeout_s) as runtime:
        # The run's objects (DDP's reducer among them) are freed when run() returns, before
        # the group they talk through is destroyed.
        return run(cfg, run_dir, runtime, choices)


def run(cfg: DictConfig, run_dir: Path, runtime, choices: dict[str, str]) -> float:  # noqa: ANN001 - Runtime
    from src.common.seeding import seed_everything
    from src.config import trusted_targets
    from src.data.loaders import build_data
    from src.loop import checkpoint, resume
    from src.loop.setup import build_task, model_fields
    from src.reports import reporting

    reporting.setup_logging(run_dir, runtime.env.rank)
    trainer_cfg: schema.TrainerConfig = OmegaConf.to_object(cfg.trainer)  # the `trainer` settings, typed
    checkpointer = checkpoint.Checkpointer(run_dir / "checkpoints", runtime.is_main_process, trainer_cfg.keep_last,
                                           sharded=cfg.dist.strategy == "fsdp")
    # A restarted or requeued run picks up where it stopped; otherwise as configured. Every rank gets
    # the same checkpoint (with auto: the newest that loads), or the run stops here, before any work.
    resumed = resume.load_resume_checkpoint(checkpointer, launch.resume_setting(cfg.resume),
                                            trusted_targets.trusted(cfg.trusted_targets, cfg))

    seed_everything(cfg.seed)  # the same initial weights on every rank
    data = build_data(cfg.dataset, runtime.env.rank, runtime.world_size, runtime.device, cfg.seed, trainer_cfg)
    # The task must fit the dataset, produce the monitored metric and find its inputs and target among the
    # dataset's fields; the model takes its shapes from what the dataset provides (`${data:FIELD}` in its YAML).
    task = build_task(cfg.task, data.splits, choices, trainer_cfg.monitor, ema=trainer_cfg.ema.decay is not None)
    with data_fields.providing(model_fields(task, data.splits.info), f"dataset={choices['dataset']}"):
        parts = build_parts(cfg, trainer_cfg, run_dir, runtime, data, task, resumed, checkpointer)
        return train_and_report(trainer_cfg, parts, resumed, run_dir)


def build_parts(cfg, trainer_cfg, run_dir, runtime, data, task, resumed, checkpointer):  # noqa: ANN001, ANN201
    """What the loop needs once the data and task are known: the model (resumed weights loaded, wrapped
    for DDP and compilation), the optimizer and schedule, the reporter and profiler (a TrainParts)."""
    import torch

    from src.loop import performance
    from src.loop.optim import build_optimizer
    from src.loop.precision import autocast_dtype
    from src.loop.trainer import TrainParts
    from src.parallel import distributed, fsdp
    from src.reports import reporting
    from src.sweeps import pruning  # an Optuna sweep's trial: its pruner may stop the run after an epoch

    performance.set_backend_flags(runtime.device, trainer_cfg.tf32, trainer_cfg.deterministic)
    model = initial_model(cfg, trainer_cfg, resumed, task)
    sharding = OmegaConf.to_object(cfg.dist.fsdp) if cfg.dist.strategy == "fsdp" else None
    module, train_model = distributed.prepare_model(model, runtime, cfg.dist.sync_bn, cfg.dist.find_unused_parameters,
                                                    sharding, autocast_dtype(trainer_cfg.precision))
    if trainer_cfg.compile:
        train_model = torch.compile(train_model)
    # Frozen parameters (trainer.freeze) get no optimizer state.
    optimizer = build_optimizer(cfg.optimizer, [p for p in module.parameters() if p.requires_grad],
                                sharded=fsdp.is_sharded(module))
    steps_per_epoch = data.train_sampler.steps_per_epoch
    scheduler = instantiate(cfg.scheduler)(optimizer, total_steps=steps_per_epoch * trainer_cfg.epochs,
                                           steps_per_epoch=steps_per_epoch)
    reporter = reporting.Reporter(run_dir, runtime.is_main_process, progress=trainer_cfg.progress)
    profiler = None
    if trainer_cfg.profile:
        from src.reports.profiling import step_profiler

        profiler = step_profiler(run_dir / "tb" / "profile", runtime.env.rank)
    saved_config = {**OmegaConf.to_container(cfg, resolve=True), "data_fields": data_fields.used_by(cfg.model)}
    return TrainParts(runtime, task, module, train_model, optimizer, scheduler, data, checkpointer, reporter,
                      seed=cfg.seed, saved_config=saved_config, profiler=profiler,
                      epoch_judge=pruning.epoch_judge(runtime.is_main_process, trainer_cfg.monitor))


def initial_model(cfg, trainer_cfg, resumed, task):  # noqa: ANN001, ANN201 - DictConfig, TrainerConfig, Resumed, Task
    """The model (refused if it cannot take the task's inputs) and the weights it starts from: the resumed run's;
    else, on a fresh start, those of
    `init_from` (weights only: the optimizer, schedule and step count start afresh); else its fresh
    initialisation. Then the parameters `trainer.freeze` names are frozen, before DDP and the optimizer
    see them. Weights that do not fit are refused before the run writes anything."""
    from src.loop import checkpoint, init_from, performance
    from src.loop.setup import build_model

    model = performance.with_memory_format(build_model(cfg.model, task), trainer_cfg.channels_last)
    if resumed is not None and "model" in resumed[1]:  # a sharded checkpoint's: read once the model is sharded
        checkpoint.load_model_state(model, resumed[1]["model"], resumed[0])
        if cfg.init_from is not None:
            log.info("init_from=%s not applied: the run resumes from %s", cfg.init_from, resumed[0])
    elif cfg.init_from is not None:
        init_from.load_on_every_rank(model, Path(cfg.init_from), cfg.init_from_strict)
    init_from.freeze(model, trainer_cfg.freeze)
    return model


def train_and_report(trainer_cfg, parts, resumed, run_dir: Path) -> float:  # noqa: ANN001
    """Train (from the resumed state, if any), then report; returns the last monitored value."""
    from src.loop.trainer import Trainer, TrainState
    from src.reports import reporting

    trainer = Trainer(trainer_cfg, parts)
    state = TrainState()
    if resumed is not None:
        resume_from, payload = resumed
        state = trainer.load_state_dict(payload)
        log.info("resumed from %s after epoch %d, step %d (%d steps into epoch %d)", resume_from, state.epoch,
                 state.step, state.step_in_epoch, state.epoch + 1)
    reporting.log_run_start(run_dir, parts.runtime, parts.module, parts.data, trainer_cfg.grad_accum,
                            parts.saved_config, parts.task.unit)
    parts.reporter.model_summary(parts.module)
    parts.reporter.input_images(parts.data.splits, parts.data.train_sampler, parts.task)
    if not trainer.fit(state).is_final:  # max_steps or preemption, with a checkpoint
        log.info("stopped at step %d with a checkpoint; continue with: resume=auto hydra.run.dir=%s",
                 state.step, run_dir)
        return state.history[-1][trainer_cfg.monitor] if state.history else float("nan")
    return report_final(trainer, state, run_dir)


def report_final(trainer, state, run_dir: Path) -> float:  # noqa: ANN001 - Trainer, TrainState
    """The finished run's hparams and final metrics; returns the monitored one."""
    from src.reports.hparams import run_hparams

    parts = trainer.parts
    summary = trainer.summary(state, parts.data.num_val_samples)
    final = {k: v for k, v in summary.items()
             if k.startswith(("train/", "val/", "val_ema/")) and not k.startswith("val/num_")}
    hydra_cfg = HydraConfig.get()  # the run's command line and chosen options: what its HParams line shows
    hparams = run_hparams(parts.saved_config, hydra_cfg.overrides.task, hydra_cfg.runtime.choices,
                          parts.data.train_sampler.global_batch_size)
    parts.reporter.hparams(hparams, final)
    parts.reporter.close()
    log.info("final: %s", "  ".join(f"{k}={v:.4f}" for k, v in final.items()))
    log.info("run dir: %s", run_dir)
    return summary[trainer.config.monitor]


if __name__ == "__main__":
    launch.die_with_launcher()  # a worker of dist.nproc_per_node ends with the process that started it
    heap.pause_collection()  # resumed in train(), once the imports are done
    launch.adopt_cluster_env()
    with hydra_errors.one_line_config_errors(launch.is_main_process()):
        main()
    # A worker that ran a DDP group skips the interpreter's teardown, which the group's threads could
    # abort (src/parallel/distributed.py). Only here, after every job: errors exit as usual above.
    if launch.is_worker():
        from src.parallel.distributed import exit_after_a_group

        exit_after_a_group()
