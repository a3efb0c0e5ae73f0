"""Train a classifier, on one process or as one worker of a DDP group.

    python train.py                                   # one process (CPU or one GPU)
    torchrun --nproc_per_node=2 train.py model=cnn    # a DDP group of 2 workers
    python train.py dist.nproc_per_node=2             # the same group, started from here
    python train.py --help                            # config groups and options

The story of a run: compose the config (Hydra), join the process group, build the
data, model, optimizer and schedule, resume if asked, train, report. Each step is one
call into `src/`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from src import config_schema, heap, launch, retries
from src.errors import exit_on_usage_error

log = logging.getLogger("train")

launch.register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Hydra's entry point; returns the final val accuracy (what sweepers optimise)."""
    # torch and everything built on it load inside train(), not at the top: `--help` and
    # `--cfg job` answer without paying seconds for imports they do not use.
    config_schema.config_composed()  # from here on, errors are the run's (Hydra reports them as usual)
    launch.adopt_cluster_env()  # submitit / SLURM tasks become torchrun-style workers
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    with exit_on_usage_error(launch.is_main_rank(), in_sweep=hydra_cfg.mode == RunMode.MULTIRUN):
        config_schema.check_train_config(cfg)  # values the schema's types cannot refuse, before any work
        if cfg.dist.nproc_per_node > 1 and not launch.is_worker():
            heap.resume_collection()  # this process only waits on its workers, for as long as they run
            launch.launch_workers(__file__, cfg.dist.nproc_per_node, run_dir, hydra_cfg.overrides.task,
                                  cfg.dist.master_port, cfg.trainer.device, cfg.dist.backend)
            return json.loads((run_dir / "metrics.json").read_text())["val/acc"]
        return launch.recording_errors(train)(cfg, run_dir)


def train(cfg: DictConfig, run_dir: Path) -> float:
    """Join the process group, run, leave it."""
    from src import distributed

    with distributed.process_group(cfg.trainer.device, cfg.dist.backend, cfg.dist.timeout_s,
                                   cfg.dist.step_timeout_s) as runtime:
        # The run's objects (DDP's reducer among them) are freed when run() returns, before
        # the group they talk through is destroyed.
        return run(cfg, run_dir, runtime)


def run(cfg: DictConfig, run_dir: Path, runtime) -> float:  # noqa: ANN001 - src.distributed.Runtime
    import torch

    from src import checkpoint, distributed, performance, reporting
    from src.data import DataLimits, build_data
    from src.models import build_model
    from src.optim import build_optimizer
    from src.seeding import seed_everything
    from src.trainer import Trainer, TrainerOptions, TrainState

    heap.resume_collection()  # start-up's objects are frozen; what the run builds is collected as usual
    reporting.setup_logging(run_dir, runtime.env.rank)
    checkpointer = checkpoint.Checkpointer(run_dir / "checkpoints", runtime.is_main_process, cfg.trainer.keep_last)
    # A restarted or requeued run picks up where it stopped; otherwise as configured.
    resume_from = checkpointer.resume_path(launch.resume_setting(cfg.resume))  # refuse before any work is done

    seed_everything(cfg.seed)  # the same initial weights on every rank
    data = build_data(cfg.dataset, runtime.env.rank, runtime.world_size, cfg.trainer.grad_accum,
                      runtime.device, cfg.seed, DataLimits.from_config(cfg.trainer))
    performance.set_backend_flags(runtime.device, cfg.trainer.tf32, cfg.trainer.deterministic)
    model = performance.with_memory_format(build_model(cfg.model, data.splits), cfg.trainer.channels_last)
    module, train_model = distributed.prepare_model(model, runtime, cfg.dist.sync_bn, cfg.dist.find_unused_parameters)
    if cfg.trainer.compile:
        train_model = torch.compile(train_model)
    optimizer = build_optimizer(cfg.optimizer, module.parameters())
    steps_per_epoch = data.train_sampler.steps_per_epoch
    scheduler = instantiate(cfg.scheduler)(optimizer, total_steps=steps_per_epoch * cfg.trainer.epochs,
                                           steps_per_epoch=steps_per_epoch)

    reporter = reporting.Reporter(run_dir, runtime.is_main_process, progress=cfg.trainer.progress)
    profiler = None
    if cfg.trainer.profile:
        from src.profiling import step_profiler

        profiler = step_profiler(run_dir / "tb" / "profile", runtime.env.rank)
    trainer = Trainer(TrainerOptions.from_config(cfg.trainer, cfg.seed), runtime, module, train_model,
                      optimizer, scheduler, data, checkpointer, reporter, profiler)
    state = TrainState()
    if resume_from is not None:
        payload = checkpoint.load(resume_from)
        checkpoint.load_model_state(module, payload["model"], resume_from)
        state = trainer.load_state_dict(payload)
        log.info("resumed from %s after epoch %d, step %d (%d steps into epoch %d)", resume_from, state.epoch,
                 state.step, state.step_in_epoch, state.epoch + 1)

    config = OmegaConf.to_container(cfg, resolve=True)
    reporting.log_run_start(run_dir, runtime, module, data, cfg.trainer.grad_accum, config)
    reporter.model_summary(module)
    reporter.input_images(data.splits.train, data.train_sampler)
    state = trainer.fit(state, config)
    if state.stopped_early:
        log.info("stopped at step %d with a checkpoint; continue with: resume=auto hydra.run.dir=%s",
                 state.step, run_dir)
        return state.history[-1]["val/acc"] if state.history else float("nan")

    summary = trainer.summary(state, data.num_val_samples)
    reporter.hparams(reporting.flatten(config), {k: v for k, v in summary.items() if "/" in k})
    reporter.close()
    log.info("final: %s", "  ".join(f"{k}={summary[k]:.4f}" for k in reporting.FINAL_METRICS))
    log.info("run dir: %s", run_dir)
    return summary["val/acc"]


if __name__ == "__main__":
    retries.exit_if_failed_for_good()  # a restart after a usage error would only stop on it again
    heap.pause_collection()  # resumed in run(), once the imports are done
    launch.adopt_cluster_env()
    with config_schema.one_line_config_errors(launch.is_main_rank()):
        main()
