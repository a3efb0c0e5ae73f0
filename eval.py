"""Evaluate a checkpoint of train.py on the val split, on one process or as a DDP group.

    python eval.py checkpoint=outputs/DATE/TIME/checkpoints/best.pt
    torchrun --nproc_per_node=2 eval.py checkpoint=PATH    # the val split sharded over 2 workers
    python eval.py checkpoint=PATH dataset.root=/data       # the checkpoint's dataset, one key changed
    python eval.py --help                                   # options (conf/eval.yaml)

The story of an evaluation: read the checkpoint, join the process group, build the
val split and the saved model, evaluate, report. The model comes from the config saved
in the checkpoint, so naming the file is enough; the metrics are exact on any number of
processes (every val sample counted once) and land in this run's own dir.
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from src.common import heap
from src.common.errors import UsageError, exit_on_usage_error
from src.config import data_fields, hydra_errors, schema
from src.parallel import launch

log = logging.getLogger("eval")

launch.register_resolvers()
# The default `dataset` option: an empty node that dataset.KEY=VALUE overrides fill in, to be
# merged onto the checkpoint's dataset config. Hydra closes the whole config to new keys
# (struct mode), which would make users type `+dataset.KEY=VALUE`; a node whose own struct flag
# is off stays open. YAML cannot set that flag, hence a node registered here rather than a file
# in conf/dataset/ (where train.py would offer it too).
FROM_CHECKPOINT = "checkpoint"
ConfigStore.instance().store(group="dataset", name=FROM_CHECKPOINT, node=OmegaConf.create({}, flags={"struct": False}))


@hydra.main(version_base="1.3", config_path="conf", config_name="eval")
def main(cfg: DictConfig) -> float:
    """Hydra's entry point; returns the val value of the checkpoint's monitored metric."""
    # As in train.py, torch loads inside evaluate_checkpoint(), so `--help` stays fast.
    hydra_errors.config_composed()  # from here on, errors are the run's (Hydra reports them as usual)
    launch.adopt_cluster_env()  # submitit / SLURM tasks become torchrun-style workers
    hydra_cfg = HydraConfig.get()
    with exit_on_usage_error(launch.is_main_process(), in_sweep=hydra_cfg.mode == RunMode.MULTIRUN):
        schema.check_eval_config(cfg)  # values the schema's types cannot refuse, before any work
        evaluate_job = launch.recording_errors(evaluate_checkpoint)
        return evaluate_job(cfg, hydra_cfg.runtime.choices.dataset, Path(hydra_cfg.runtime.output_dir))


def evaluate_checkpoint(cfg: DictConfig, dataset_choice: str, run_dir: Path) -> float:
    """Evaluate `cfg.checkpoint` on this rank's shard of the val split with the task it was trained
    on; every rank returns the val value of its monitored metric over all of the split.
    `dataset_choice` is the `dataset` option Hydra composed."""
    from hydra.utils import instantiate

    from src.loop.precision import autocast_dtype
    from src.parallel import distributed
    from src.reports import reporting

    heap.resume_collection()  # start-up's objects are frozen; what the evaluation builds is collected as usual
    path, payload = read_checkpoint(cfg)
    saved = OmegaConf.create(payload["config"])  # the resolved config of the run that saved it
    dataset_cfg = cfg.dataset if dataset_choice != FROM_CHECKPOINT else merge_dataset(saved.dataset, cfg.dataset, path)
    amp_dtype = autocast_dtype(saved.trainer.precision if cfg.trainer.precision is None else cfg.trainer.precision)

    if "task" not in saved:
        raise UsageError(f"{path} was saved before tasks existed (no task in its config): train it again")
    task = instantiate(saved.task)
    monitored = f"val/{saved.trainer.monitor.split('/', 1)[1]}"  # val/<name>: what this split can measure

    with distributed.process_group(cfg.trainer.device, cfg.dist.backend, cfg.dist.timeout_s) as runtime:
        reporting.setup_logging(run_dir, runtime.env.rank, name="eval")
        val = evaluate_saved_model(path, payload, task, dataset_cfg, dataset_choice, runtime, amp_dtype, cfg.weights)
        return report(val, path, payload["epoch"], runtime, run_dir, cfg.weights, task.unit)[monitored]


def read_checkpoint(cfg: DictConfig) -> tuple[Path, dict]:
    """The checkpoint `cfg` names, refused before any work if it is not one or names untrusted code."""
    from src.config import trusted_targets
    from src.loop import checkpoint

    if OmegaConf.is_missing(cfg, "checkpoint"):
        raise UsageError("name the checkpoint to evaluate: python eval.py checkpoint=PATH")
    path = Path(cfg.checkpoint)
    payload = checkpoint.load(path)  # refuse a wrong file before any work is done
    # Checkpoints are data: the callables its saved config names must be ones the user trusts.
    trusted_targets.check_saved_config(payload.get("config"), path, trusted_targets.trusted(cfg.trusted_targets, cfg))
    if cfg.weights == "ema" and "ema" not in payload:
        raise UsageError(f"{path} holds no EMA weights (its run had trainer.ema.decay=null): evaluate its model "
                         "with weights=model")
    return path, payload


def evaluate_saved_model(path, payload, task, dataset_cfg, dataset_choice, runtime, amp_dtype,  # noqa: ANN001
                         weights: str = "model") -> dict:
    """The checkpoint's model with its `weights` (model or ema), on the val split of `dataset_cfg` (which must
    fit it): this rank's shard, the metrics over all ranks."""
    from src.data.loaders import build_splits, make_val_loader
    from src.loop import checkpoint
    from src.loop.evaluation import evaluate
    from src.loop.setup import bind_to_dataset, build_model, check_fit, model_fields

    saved = OmegaConf.create(payload["config"])
    splits = build_splits(dataset_cfg)
    check_fit(task, splits.info, saved.task._target_, f"{dataset_choice} ({dataset_cfg._target_})")
    bind_to_dataset(task, splits, f"dataset={dataset_choice}")  # the task's inputs and target, by the data's fields
    data_fields.check_same(payload["config"].get("data_fields"), model_fields(task, splits.info),
                           f"checkpoint {path}", f"dataset={dataset_choice}")
    # The plain module, not DDP: evaluation syncs no gradients, only the metric sums. Its config
    # was saved resolved, with the shapes it was built with.
    module = build_model(saved.model, task)
    if "sharded" in payload:  # dist=fsdp's directory: its shards read into the whole model on every rank
        from src.loop import sharded_checkpoint

        sharded_checkpoint.load_model(module, payload)
    else:
        checkpoint.load_model_state(module, payload[weights], path)
    module.to(runtime.device)
    val_batch = dataset_cfg.get("val_batch_size") or dataset_cfg.batch_size
    loader = make_val_loader(splits, val_batch, runtime.env.rank, runtime.world_size,
                             runtime.device, dataset_cfg.num_workers, saved.seed)
    return evaluate(module, loader, task, splits.info, runtime.device, amp_dtype)


def report(val: dict, path: Path, epoch: int, runtime, run_dir: Path,  # noqa: ANN001 - Runtime
           weights: str = "model", unit: str = "samples") -> dict:
    """Write the val metrics to this evaluation's metrics.json and the log; returns what was written. The count
    is named by the task's `unit`: num_samples, num_tokens, ..."""
    from src.reports import reporting

    metrics = {f"val/{name}": value for name, value in val.items() if isinstance(value, float)}
    result = {**metrics, f"num_{unit}": val["count"], "world_size": runtime.world_size,
              "checkpoint": str(path.resolve()), "epoch": epoch, "weights": weights}
    reporting.Reporter(run_dir, runtime.is_main_process, tensorboard=False).write_metrics(result)
    log.info("%s  num_%s=%d  world_size=%d  checkpoint %s (epoch %d, %s weights)  run dir: %s",
             "  ".join(f"{k}={v:.6f}" for k, v in metrics.items()), unit, val["count"], runtime.world_size, path,
             epoch, weights, run_dir)
    return result


def merge_dataset(saved_dataset: DictConfig, overrides: DictConfig, path: Path) -> DictConfig:
    """The checkpoint's dataset config with the command line's dataset.KEY=VALUE applied.

    Only keys the saved config has may be changed, so a misspelt key is an error here
    rather than an unexpected argument deep inside the dataset builder.
    """
    OmegaConf.set_struct(saved_dataset, True)
    try:
        return OmegaConf.merge(saved_dataset, overrides)
    except ConfigKeyError as error:
        raise UsageError(
            f"dataset.{error.key} is not a key of the dataset config saved in {path} "
            f"({', '.join(map(str, saved_dataset))}); choose another dataset with dataset=NAME"
        ) from None


if __name__ == "__main__":
    heap.pause_collection()  # resumed in evaluate_checkpoint(), once the imports are done
    launch.adopt_cluster_env()
    with hydra_errors.one_line_config_errors(launch.is_main_process()):
        main()
