"""Evaluate a checkpoint of train.py on the test split (or the val split), on one process or as a DDP group.

    python eval.py checkpoint=outputs/DATE/TIME/checkpoints/best.pt
    python eval.py checkpoint=PATH split=val               # the val split (default: test where there is one)
    torchrun --nproc_per_node=2 eval.py checkpoint=PATH    # the split sharded over 2 workers
    python eval.py checkpoint=PATH dataset.root=/data       # the checkpoint's dataset, one key changed
    python eval.py --help                                   # options (conf/eval.yaml)

The story of an evaluation: read the checkpoint, join the process group, build the
split and the saved models, evaluate, report. The models come from the config saved
in the checkpoint, so naming the file is enough; the metrics are exact on any number of
processes (every sample counted once) and land in this run's own dir.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from src import checkpoint
from src.checkpoint import trained
from src.checkpoint.store import Checkpoint
from src.common.errors import UsageError
from src.config import building, data_fields, schema, trusted_targets
from src.data import loaders
from src.data.splits import DataSplits
from src.loop import performance, task_and_model, trainer
from src.loop.task import Task
from src.parallel import distributed, job, workers
from src.parallel.distributed import Runtime
from src.reports import reporting

log = logging.getLogger("eval")

# The default `dataset` option: an empty node that dataset.KEY=VALUE overrides fill in, to be merged onto the
# checkpoint's dataset config. Hydra closes the whole config to new keys (struct mode), which would make users
# type `+dataset.KEY=VALUE`; a node whose own struct flag is off stays open. YAML cannot set that flag, hence a
# node registered here rather than a file in conf/dataset/ (where train.py would offer it too).
FROM_CHECKPOINT = "checkpoint"
ConfigStore.instance().store(group="dataset", name=FROM_CHECKPOINT, node=OmegaConf.create({}, flags={"struct": False}))


@hydra.main(version_base="1.3", config_path="conf", config_name="eval")
def main(cfg: DictConfig) -> float:
    """Hydra's entry point; returns the checkpoint's monitored metric on the split evaluated (NaN if none)."""
    context = job.start()
    with job.usage_errors(context):
        schema.check_eval_config(cfg)  # values the schema's types cannot refuse, before any work
        return evaluate_checkpoint(cfg, context.choices["dataset"], context.run_dir)


@workers.worker  # under a launcher: failures reported to it
def evaluate_checkpoint(cfg: DictConfig, dataset_choice: str, run_dir: Path) -> float:
    """Evaluate `cfg.checkpoint` on this rank's shard of the split (`cfg.split`) with the task it was trained on;
    every rank returns the value of its monitored metric over all of the split. `dataset_choice` is the `dataset`
    option Hydra composed."""
    saved_checkpoint = read_checkpoint(cfg)
    saved = OmegaConf.create(saved_checkpoint.config)  # the resolved config of the run that saved it
    dataset_cfg = cfg.dataset if dataset_choice != FROM_CHECKPOINT else merge_dataset(saved.dataset, cfg.dataset,
                                                                                      saved_checkpoint.path)
    with building.errors_named("task", saved.task):
        task = instantiate(saved.task)

    with distributed.process_group(cfg.trainer.device, cfg.dist.backend, cfg.dist.timeout_s) as runtime:
        reporting.setup_logging(run_dir, runtime.env.rank, name="eval")
        task.aux = task_and_model.build_aux(saved.get("aux"), task, runtime.device,
                                            trusted_targets.trusted(cfg.trusted_targets, cfg))
        splits = loaders.build_splits(dataset_cfg)
        named = "the checkpoint's dataset" if dataset_choice == FROM_CHECKPOINT else f"dataset={dataset_choice}"
        split = check_data(saved_checkpoint, task, splits, cfg.split, named)
        # The plain modules, not DDP: evaluation syncs no gradients, only the metric sums. A sharded checkpoint's
        # shards are read into the whole models on every rank; `weights=ema` puts the EMA weights into their model.
        output = saved_checkpoint.output_model
        modules = {name: trained.build_saved_model(saved_checkpoint, name, cfg.weights if name == output else "model")
                   .to(runtime.device) for name in saved_checkpoint.model_names}
        if task.feeds_batches:  # the model the task feeds batches: one line if it cannot take them
            task_and_model.check_inputs(modules[output], task)
        loader = functools.partial(loaders.make_eval_loader, global_batch_size=dataset_cfg.get("val_batch_size")
                                   or dataset_cfg.batch_size, rank=runtime.env.rank, world_size=runtime.world_size,
                                   device=runtime.device, num_workers=int(dataset_cfg.get("num_workers") or 0),
                                   seed=saved.seed)
        amp_dtype = performance.autocast_dtype(cfg.trainer.precision or saved.trainer.precision)
        metrics = trainer.evaluate(task, modules, lambda name: loader(getattr(splits, name)), splits.info,
                                      runtime.device, amp_dtype, saved.seed, split=split)
        result = report(metrics, split, saved_checkpoint, runtime, run_dir, cfg.weights, task.unit)
        monitor = saved.trainer.monitor  # <split>/<name>: what this split can measure
        return result.get(f"{split}/{monitor.split('/', 1)[1]}", float("nan")) if monitor else float("nan")


def read_checkpoint(cfg: DictConfig) -> Checkpoint:
    """The checkpoint `cfg` names, refused before any work if it is not one or names untrusted code."""
    if OmegaConf.is_missing(cfg, "checkpoint"):
        raise UsageError("name the checkpoint to evaluate: python eval.py checkpoint=PATH")
    path = Path(cfg.checkpoint)
    saved = checkpoint.read(path)  # refuse a wrong file before any work is done
    # Checkpoints are data: the callables its saved config names must be ones the user trusts.
    trusted_targets.check_saved_config(saved.config, path, trusted_targets.trusted(cfg.trusted_targets, cfg))
    if not saved.has_weights(cfg.weights):
        which = "" if saved.output_model == "model" else f" of its model {saved.output_model}"
        raise UsageError(f"{path} holds no EMA weights{which} (its run had callbacks.ema.decay=null): evaluate its "
                         "model with weights=model")
    return saved


def check_data(saved: Checkpoint, task: Task, splits: DataSplits, split: str | None, dataset: str) -> str:
    """Bind the task to the data and refuse, in one line, data the checkpoint's task or models do not fit, or a
    `split` it lacks; returns the split to evaluate (None: test where there is one, else val)."""
    task_and_model.check_fit(task, splits.info, f"the checkpoint's task ({saved.config['task']['_target_']})", dataset,
                             "evaluate it on a dataset that task fits")
    task_and_model.bind_to_dataset(task, splits, dataset)  # the task's inputs and target, by field
    split = split or ("test" if splits.test is not None else "val")
    if getattr(splits, split) is None:
        raise UsageError(f"{dataset} has no {split} split: evaluate split=val")
    data_fields.check_same(saved.config.get("data_fields"), task_and_model.model_fields(task, splits.info),
                           f"checkpoint {saved.path}", dataset)
    return split


def report(evaluated: dict[str, Any], split: str, saved: Checkpoint, runtime: Runtime, run_dir: Path,
           weights: str = "model", unit: str = "samples") -> dict[str, Any]:
    """Write the split's metrics to this evaluation's metrics.json and the log; returns what was written. The count
    is named by the task's `unit`: num_samples, num_tokens, ..."""
    metrics = {f"{split}/{name}": value for name, value in evaluated.items() if isinstance(value, float)}
    epoch = saved.loop["epoch"]
    result = {**metrics, f"num_{unit}": evaluated["count"], "split": split, "world_size": runtime.world_size,
              "checkpoint": str(saved.path.resolve()), "epoch": epoch, "weights": weights}
    reporting.Reporter(run_dir, runtime.is_main_process, tensorboard=False).write_metrics(result)
    log.info("%s  num_%s=%d  world_size=%d  checkpoint %s (epoch %d, %s weights)  run dir: %s",
             "  ".join(f"{k}={v:.6f}" for k, v in metrics.items()), unit, evaluated["count"], runtime.world_size,
             saved.path, epoch, weights, run_dir)
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
    job.run(main, config_name="eval")
