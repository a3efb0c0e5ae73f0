"""Train a model on a task, on one process or as one worker of a DDP (or FSDP) group.

    python train.py                                   # one process (CPU or one GPU)
    torchrun --nproc_per_node=2 train.py model=cnn    # a group of 2 workers
    python train.py dist.nproc_per_node=2             # the same group, started from here
    python train.py --help                            # config groups and options

The story of a run: compose the config (Hydra), join the process group, build the data, the task, the
callbacks and the models with their optimizers and schedules, resume if asked, train, test, report.
"""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig, OmegaConf

from src import checkpoint
from src.checkpoint.resume import load_resume_checkpoint
from src.common.seeding import seed_everything
from src.config import data_fields, schema, trusted_targets
from src.data import loaders
from src.loop import callback, init_from, performance, task_and_model
from src.loop.trainer import Trainer, TrainParts, TrainState
from src.parallel import distributed, job, ranks, workers
from src.parallel.distributed import Runtime
from src.parallel.job import RunContext
from src.reports import reporting, tracking

log = logging.getLogger("train")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Hydra's entry point; returns the final value of the monitored metric (what sweepers optimise)."""
    context = job.start()
    with job.usage_errors(context):  # each one `error:` line; a run dir left unused is removed
        schema.check_train_config(cfg)  # values the schema's types cannot refuse, before any work
        if cfg.dist.nproc_per_node > 1 and not ranks.is_worker():
            return workers.run_group(__file__, cfg, context)  # start the workers, wait for them
        return train(cfg, context)


@workers.worker  # under a launcher: failures reported to it, and the worker ends with it
def train(cfg: DictConfig, context: RunContext) -> float:
    """Join the process group, run, leave it."""
    with distributed.process_group(cfg.trainer.device, cfg.dist.backend, cfg.dist.timeout_s,
                                   cfg.dist.step_timeout_s) as runtime:
        return run(cfg, context, runtime)


def run(cfg: DictConfig, context: RunContext, runtime: Runtime) -> float:
    reporting.setup_logging(context.run_dir, runtime.env.rank)
    trackers = tracking.build_trackers(cfg.logger, context, runtime.is_main_process)  # a missing package: one line
    trainer_cfg: schema.TrainerConfig = OmegaConf.to_object(cfg.trainer)  # the `trainer` settings, typed
    store = checkpoint.open_store(cfg.dist, trainer_cfg, context.run_dir / "checkpoints", runtime.is_main_process)
    # A restarted or requeued run picks up where it stopped; otherwise as configured. Every rank gets
    # the same checkpoint (with auto: the newest that loads), or the run stops here, before any work.
    trusted = trusted_targets.trusted(cfg.trusted_targets, cfg)
    resumed = load_resume_checkpoint(store.directory, runtime.is_main_process, cfg.resume,
                                     trusted)

    seed_everything(cfg.seed)  # the same initial weights on every rank
    data = loaders.build_data(cfg.dataset, runtime.env.rank, runtime.world_size, runtime.device, cfg.seed,
                              trainer_cfg)
    callbacks = callback.build_callbacks(cfg.callbacks, trackers)
    # The task must fit the dataset, produce the monitored metric (callbacks add some, e.g. val_ema/*) and find
    # its inputs and target among the dataset's fields; the model config's ${data:FIELD}s are filled in.
    task = task_and_model.build_task(cfg.task, data.splits, context, trainer_cfg.monitor, callbacks, cfg.model)
    saved_config = data_fields.fill_model_config(cfg, task_and_model.model_fields(task, data.splits.info),
                                                 context.choices["dataset"])

    performance.set_backend_flags(runtime.device, trainer_cfg.tf32, trainer_cfg.deterministic)
    task.aux = task_and_model.build_aux(cfg.aux, task, runtime.device, trusted)  # frozen models the task reads
    modules, train_models = task_and_model.build_trained(cfg, trainer_cfg, task, runtime)  # wrapped, sharded, compiled
    init_from.starting_weights(cfg.init_from, cfg.init_from_strict, modules, task.output_model, resumed)
    optimizers, schedulers = task_and_model.build_optimizers(cfg, modules, data.train_sampler.steps_per_epoch,
                                                             trainer_cfg.epochs)
    reporter = reporting.Reporter(context.run_dir, runtime.is_main_process, "tensorboard" in cfg.logger,
                                  trainer_cfg.progress, trackers)
    parts = TrainParts(runtime, task, modules, train_models, optimizers, schedulers, data, store, reporter,
                       callbacks, seed=cfg.seed, saved_config=saved_config)

    loop, state = Trainer(trainer_cfg, parts), TrainState()
    if resumed is not None:  # every part but the callbacks', before the run writes anything
        loop.restore(state, resumed)
    reporting.log_run_start(context.run_dir, runtime, modules, data, trainer_cfg.grad_accum, saved_config,
                            context.overrides, cfg.print_config, task.unit)
    reason = loop.fit(state, resumed)  # epochs, then the final test of the chosen weights
    return loop.report(state, reason, context)


if __name__ == "__main__":
    job.run(main, config_name="config")
