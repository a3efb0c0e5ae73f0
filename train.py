"""Train a classifier, on one process or as one worker of a DDP group.

    python train.py                                   # one process (CPU or one GPU)
    torchrun --nproc_per_node=2 train.py model=cnn    # a DDP group of 2 workers
    python train.py --help                            # config groups and options

The story of a run: compose the config (Hydra), join the process group, build the
data, model, optimizer and schedule, resume if asked, train, report. Each step is one
call into `src/`.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from src import launch

log = logging.getLogger("train")

launch.register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Hydra's entry point; returns the final val accuracy (what sweepers optimise)."""
    # torch and everything built on it load here, not at the top: `--help` and
    # `--cfg job` answer without paying seconds for imports they do not use.
    from src.errors import find_usage_error

    try:
        return train(cfg, Path(HydraConfig.get().runtime.output_dir))
    except Exception as error:
        usage_error = find_usage_error(error)
        if usage_error is None:
            raise
        if launch.is_main_rank():
            print(f"error: {usage_error}", file=sys.stderr)
        sys.exit(2)


def train(cfg: DictConfig, run_dir: Path) -> float:
    from src import checkpoint, distributed, reporting
    from src.data import build_data
    from src.seeding import seed_everything
    from src.trainer import Trainer, TrainState

    with distributed.process_group(cfg.trainer.device, cfg.dist.backend, cfg.dist.timeout_s) as runtime:
        reporting.setup_logging(run_dir, runtime.env.rank)
        checkpointer = checkpoint.Checkpointer(run_dir / "checkpoints", runtime.is_main_process)
        resume_from = checkpointer.resume_path(cfg.resume)  # refuse before any work is done

        seed_everything(cfg.seed)  # identical initial weights on every rank
        data = build_data(cfg.dataset, runtime.env.rank, runtime.world_size, cfg.trainer.grad_accum,
                          runtime.device, cfg.seed)
        module = instantiate(cfg.model, in_channels=data.splits.in_channels,
                             image_size=data.splits.image_size, num_classes=data.splits.num_classes)
        module, train_model = distributed.prepare_model(module, runtime, cfg.dist.sync_bn,
                                                        cfg.dist.find_unused_parameters)
        if cfg.trainer.compile:
            train_model = torch_compile(train_model)
        optimizer = instantiate(cfg.optimizer)(params=module.parameters())
        steps_per_epoch = data.train_sampler.steps_per_epoch
        scheduler = instantiate(cfg.scheduler)(optimizer, total_steps=steps_per_epoch * cfg.trainer.epochs,
                                               steps_per_epoch=steps_per_epoch)

        reporter = reporting.Reporter(run_dir, runtime.is_main_process)
        trainer = Trainer(trainer_options(cfg), runtime, module, train_model, optimizer, scheduler,
                          data, checkpointer, reporter)
        state = TrainState()
        if resume_from is not None:
            payload = checkpoint.load(resume_from)
            checkpoint.load_model_state(module, payload["model"], resume_from)
            state = trainer.load_state_dict(payload)
            log.info("resumed from %s after epoch %d (step %d)", resume_from, state.epoch, state.step)

        log_start(cfg, runtime, module, data, run_dir)
        config = OmegaConf.to_container(cfg, resolve=True)
        state = trainer.fit(state, config)

        summary = trainer.summary(state, data.num_val_samples)
        reporter.hparams(reporting.flatten(config), {k: v for k, v in summary.items() if "/" in k})
        reporter.close()
        log.info("final: %s", "  ".join(f"{k}={summary[k]:.4f}" for k in ("train/loss", "train/acc",
                                                                            "val/loss", "val/acc")))
        log.info("run dir: %s", run_dir)
        return summary["val/acc"]


def trainer_options(cfg: DictConfig):  # noqa: ANN201 - src.trainer is imported lazily
    from src.trainer import TrainerOptions

    return TrainerOptions(
        epochs=cfg.trainer.epochs,
        seed=cfg.seed,
        precision=str(cfg.trainer.precision),
        grad_accum=cfg.trainer.grad_accum,
        grad_clip=cfg.trainer.grad_clip,
        log_every_steps=cfg.trainer.log_every_steps,
        save_checkpoints=cfg.trainer.save_checkpoints,
        monitor=cfg.trainer.monitor,
        monitor_mode=cfg.trainer.monitor_mode,
    )


def torch_compile(model):  # noqa: ANN001, ANN201
    import torch

    return torch.compile(model)


def log_start(cfg: DictConfig, runtime, module, data, run_dir: Path) -> None:  # noqa: ANN001
    """One summary of what is about to run, printed once by rank 0."""
    num_params = sum(p.numel() for p in module.parameters())
    log.info(
        "run dir %s | world size %d | device %s | backend %s | model %s (%.2fM params) | "
        "dataset %s: %d train / %d val | global batch %d = %d ranks x %d per rank x %d accum | %d steps/epoch",
        run_dir, runtime.world_size, runtime.device, runtime.backend or "none (single process)",
        type(module).__name__, num_params / 1e6, cfg.dataset._target_.rsplit(".", 1)[-1],
        len(data.splits.train), len(data.splits.val), cfg.dataset.batch_size, runtime.world_size,
        data.train_sampler.micro_batch_size, cfg.trainer.grad_accum, data.train_sampler.steps_per_epoch,
    )


if __name__ == "__main__":
    sys.argv += launch.rank_overrides()
    main()
