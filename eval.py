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
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from src import checkpoint
from src.common import heap, lazy
from src.common.errors import UsageError, exit_on_usage_error
from src.config import building, data_fields, hydra_errors, schema, trusted_targets
from src.parallel import launch, ranks
from src.parallel.launch import RunContext

# The evaluation's own modules: torch and everything built on it, imported where the evaluation begins, so
# that `--help` and `--cfg job` answer without them (src/common/lazy.py).
distributed = lazy.module("src.parallel.distributed")
workers = lazy.module("src.parallel.workers", with_the_run=False)  # a launcher's and its workers' only
loaders = lazy.module("src.data.loaders")
evaluation = lazy.module("src.loop.evaluation")
models = lazy.module("src.loop.models")
precision = lazy.module("src.loop.precision")
setup = lazy.module("src.loop.setup")
trained = lazy.module("src.checkpoint.trained")
reporting = lazy.module("src.reports.reporting")

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
    """Hydra's entry point; returns the checkpoint's monitored metric on the split evaluated (NaN if none)."""
    hydra_errors.config_composed()  # from here on, errors are the run's (Hydra reports them as usual)
    ranks.adopt_cluster_env()  # submitit / SLURM tasks become torchrun-style workers
    context = RunContext.of(HydraConfig.get())
    with exit_on_usage_error(ranks.is_main_process(), in_sweep=context.in_sweep):
        schema.check_eval_config(cfg)  # values the schema's types cannot refuse, before any work
        evaluate_job = workers.recording_errors(evaluate_checkpoint) if ranks.is_worker() else evaluate_checkpoint
        return evaluate_job(cfg, context.choices["dataset"], context.run_dir)


def evaluate_checkpoint(cfg: DictConfig, dataset_choice: str, run_dir: Path) -> float:
    """Evaluate `cfg.checkpoint` on this rank's shard of the split (`cfg.split`) with the task it was trained on;
    every rank returns the value of its monitored metric over all of the split. `dataset_choice` is the `dataset`
    option Hydra composed."""
    lazy.load_all()
    heap.resume_collection()  # start-up's objects are frozen; what the evaluation builds is collected as usual
    saved_checkpoint = read_checkpoint(cfg)
    saved = OmegaConf.create(saved_checkpoint.config)  # the resolved config of the run that saved it
    path = Path(cfg.checkpoint)
    dataset_cfg = cfg.dataset if dataset_choice != FROM_CHECKPOINT else merge_dataset(saved.dataset, cfg.dataset, path)
    amp_dtype = precision.autocast_dtype(saved.trainer.precision if cfg.trainer.precision is None
                                         else cfg.trainer.precision)

    if "task" not in saved:
        raise UsageError(f"{path} was saved before tasks existed (no task in its config): train it again")
    with building.errors_named("task", saved.task):
        task = instantiate(saved.task)

    with distributed.process_group(cfg.trainer.device, cfg.dist.backend, cfg.dist.timeout_s) as runtime:
        reporting.setup_logging(run_dir, runtime.env.rank, name="eval")
        task.aux = models.build_aux(saved.get("aux"), task, runtime.device,
                                    trusted_targets.trusted(cfg.trusted_targets, cfg))
        split, metrics = evaluate_saved_model(saved_checkpoint, task, dataset_cfg, dataset_choice, runtime, amp_dtype,
                                              cfg.weights, cfg.split)
        result = report(metrics, split, path, saved_checkpoint.loop["epoch"], runtime, run_dir, cfg.weights, task.unit)
        monitor = saved.trainer.monitor  # <split>/<name>: what this split can measure
        return result.get(f"{split}/{monitor.split('/', 1)[1]}", float("nan")) if monitor else float("nan")


def read_checkpoint(cfg: DictConfig) -> Any:
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


def evaluate_saved_model(saved_checkpoint, task, dataset_cfg, dataset_choice, runtime, amp_dtype,  # noqa: ANN001
                         weights: str = "model", split: str | None = None) -> tuple[str, dict]:
    """The checkpoint's models with its `weights` (model or ema), on `split` of `dataset_cfg` (which must fit them;
    None: test where it has one, else val): the split evaluated, and the metrics over all ranks of its shards."""
    saved = OmegaConf.create(saved_checkpoint.config)
    path = saved_checkpoint.path
    with building.errors_named("dataset", dataset_cfg, passed_elsewhere=loaders.LOADER_KEYS):
        splits = loaders.build_splits(dataset_cfg)
    setup.check_fit(task, splits.info, saved.task._target_, f"{dataset_choice} ({dataset_cfg._target_})")
    setup.bind_to_dataset(task, splits, f"dataset={dataset_choice}")  # the task's inputs and target, by field
    split = split or ("test" if splits.test is not None else "val")
    if getattr(splits, split) is None:
        raise UsageError(f"dataset={dataset_choice} has no {split} split: evaluate split=val")
    data_fields.check_same(saved_checkpoint.config.get("data_fields"), setup.model_fields(task, splits.info),
                           f"checkpoint {path}", f"dataset={dataset_choice}")
    # The plain modules, not DDP: evaluation syncs no gradients, only the metric sums. Their configs were
    # saved resolved, with the shapes they were built with; a sharded checkpoint's shards are read into the
    # whole models on every rank. `weights=ema` puts the EMA weights into the model they average.
    modules = {name: trained.build_saved_model(saved_checkpoint, name, weights if name == saved_checkpoint.output_model
                                               else "model").to(runtime.device)
               for name in saved_checkpoint.model_names}
    if task.feeds_batches:  # the model the task feeds batches: one line if it cannot take them
        setup.check_inputs(modules[saved_checkpoint.output_model], task)
    val_batch = dataset_cfg.get("val_batch_size") or dataset_cfg.batch_size
    loader = functools.partial(loaders.make_eval_loader, global_batch_size=val_batch, rank=runtime.env.rank,
                               world_size=runtime.world_size, device=runtime.device,
                               num_workers=dataset_cfg.num_workers, seed=saved.seed)
    return split, evaluation.evaluate(task, modules, lambda name: loader(getattr(splits, name)), splits.info,
                                      runtime.device, amp_dtype, saved.seed, split=split)


def report(evaluated: dict, split: str, path: Path, epoch: int, runtime, run_dir: Path,  # noqa: ANN001 - Runtime
           weights: str = "model", unit: str = "samples") -> dict:
    """Write the split's metrics to this evaluation's metrics.json and the log; returns what was written. The count
    is named by the task's `unit`: num_samples, num_tokens, ..."""
    metrics = {f"{split}/{name}": value for name, value in evaluated.items() if isinstance(value, float)}
    result = {**metrics, f"num_{unit}": evaluated["count"], "split": split, "world_size": runtime.world_size,
              "checkpoint": str(path.resolve()), "epoch": epoch, "weights": weights}
    reporting.Reporter(run_dir, runtime.is_main_process, tensorboard=False).write_metrics(result)
    log.info("%s  num_%s=%d  world_size=%d  checkpoint %s (epoch %d, %s weights)  run dir: %s",
             "  ".join(f"{k}={v:.6f}" for k, v in metrics.items()), unit, evaluated["count"], runtime.world_size, path,
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
    with hydra_errors.one_line_config_errors(ranks.is_main_process(), "eval"):
        main()
