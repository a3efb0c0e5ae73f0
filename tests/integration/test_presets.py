"""Presets and diagnostics through the real CLI: debug=fast|overfit|profile, experiment=*,
and the NaN guard (`callbacks.divergence.detect_anomaly`). The tests that launch training are marked slow (out of
`make test-fast`, as every launched training run is); those that compose the presets are fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, check, metrics, train
from dataset_files import write_cifar10, write_mnist
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lazy_runs import LazyRuns
from omegaconf import OmegaConf

from src.common.errors import UsageError
from src.config import schema  # noqa: F401 - registers the schema
from src.data.loaders import build_splits
from src.parallel import job  # noqa: F401 - registers ${run_timestamp:}, ${data:} ... as train.py does

EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))


def only_run_dir(workdir: Path, parent: str) -> Path:
    (run_dir,) = [p for p in (workdir / parent).glob("*/*") if p.is_dir()]
    return run_dir


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.mark.slow  # launches training
def test_debug_fast_is_a_two_step_smoke_run_kept_apart(workdir: Path):
    check(train(["debug=fast"], workdir))
    run_dir = only_run_dir(workdir, "outputs/debug")
    # Nothing else: OmegaConf resolved the default run dir as it merged the preset's onto it, which made that dir.
    assert [path.name for path in (workdir / "outputs").iterdir()] == ["debug"]
    result = metrics(run_dir)
    assert (result["epoch"], result["step"]) == (1, 2)
    assert result["val/num_samples"] == 2 * 64  # limit_val_batches=2 batches of the global 64 (1 rank)
    assert not (run_dir / "checkpoints").exists()


@pytest.mark.slow  # launches training
def test_debug_overfit_drives_the_loss_to_zero(runs: LazyRuns):
    result = metrics(runs("debug=overfit"))
    assert result["step"] == 20 * 2  # 2 batches per epoch
    assert result["val/num_samples"] == 128  # validated on the same 2 batches
    assert result["train/loss"] < 0.05 and result["val/loss"] < 0.05
    assert result["val/acc"] == 1.0
    assert result["history"][0]["train/loss"] > 1.0  # it really learned


@pytest.mark.slow  # launches training
def test_debug_profile_writes_a_trace_of_the_recorded_steps(runs: LazyRuns):
    run_dir = runs("debug=profile")
    (trace,) = (run_dir / "tb" / "profile").glob("rank0.*.pt.trace.json")
    names = {event.get("name", "") for event in json.loads(trace.read_text())["traceEvents"]}
    # wait=1, warmup=1, active=3: the trace holds steps 2..4 (0-based profiler steps).
    assert {name for name in names if name.startswith("ProfilerStep#")} == {"ProfilerStep#2", "ProfilerStep#3",
                                                                           "ProfilerStep#4"}
    assert any("conv2d" in name for name in names)


def composed(overrides: list[str]):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


# Each preset's (task, dataset, model) targets.
PRESET_TARGETS = {
    "digits_cnn": ("Classification", "digits", "src.components.models.SimpleCNN"),
    "mnist_cnn": ("Classification", "mnist", "src.components.models.SimpleCNN"),
    "fashion_mnist_cnn": ("Classification", "fashion_mnist", "src.components.models.SimpleCNN"),
    "cifar10_resnet18": ("Classification", "cifar10", "src.components.models.resnet18"),
    "seed_tabular_binary": ("Binary", "breast_cancer", "src.components.models.MLP"),
    "seed_two_input_l1": ("Regression", "two_input_synthetic", "src.components.models.TwoInputCNN"),
    "seed_cifar10_lenet": ("Classification", "cifar10", "src.components.models.LeNet5"),
    # The research recipes (src/recipes/): a task of their own; several models by name for the GAN.
    "gan_digits": ("src.recipes.gan.GAN", "digits", {"generator": "src.components.models.MLP",
                                                      "discriminator": "src.components.models.MLP"}),
    "distill_digits": ("src.recipes.distill.Distillation", "digits", "src.components.models.MLP"),
    "simclr_digits": ("src.recipes.simclr.SimCLR", "digits", "src.components.models.MLP"),
    # Fine-tuning from pretrained weights (src/components/pretrained.py).
    "finetune_timm": ("Classification", "image_folder", "src.components.pretrained.timm_model"),
    "segment_shapes": ("Segmentation", "shapes", "src.components.pretrained.TimmSegmentation"),
}
# What a preset leaves for the user to name, and the one line that says so until then.
REQUIRED = {"distill_digits": ("aux.teacher.path", "teacher.pt"), "finetune_timm": ("dataset.root", "images")}


@pytest.mark.template
def test_the_template_s_presets_are_all_there():
    assert set(PRESET_TARGETS) <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_with_its_groups(name: str):
    """Every preset composes and passes the value checks (a fork's own too); the template's build what they say."""
    cfg = composed([f"experiment={name}"])
    if name in PRESET_TARGETS:
        task, dataset, model = PRESET_TARGETS[name]
        assert cfg.task._target_ == (task if "." in task else f"src.components.tasks.{task}")
        assert cfg.dataset._target_ == f"src.components.datasets.{dataset}"
        if isinstance(model, dict):
            assert {name: node._target_ for name, node in cfg.model.items()} == model
        else:
            assert cfg.model._target_ == model
    if name in REQUIRED:
        key, value = REQUIRED[name]
        with pytest.raises(UsageError, match=f"{key} is required: add {key}=VALUE"):
            schema.check_train_config(cfg)
        OmegaConf.update(cfg, key, value)
    schema.check_train_config(cfg)


def test_seed_presets_carry_the_seed_hyperparameters():
    two_input = composed(["experiment=seed_two_input_l1"])
    # No layout restated: the task takes model(rgb, mask) and the target from the dataset's named fields.
    assert (two_input.task.loss, two_input.task.inputs, two_input.task.target) == ("l1", None, None)
    task, splits = instantiate(two_input.task), build_splits(two_input.dataset)
    task.bind(splits.fields, splits.target)
    assert (task.binding.args, task.binding.target) == (("rgb", "mask"), "target")
    (rgb, mask), _, target = task.split(splits.train[:2])  # parts 0 and 1 in, part 2 the target
    assert all(torch.equal(a, b) for a, b in zip((rgb, mask, target), splits.train[:2]))
    assert two_input.optimizer._target_ == "torch.optim.Adam" and two_input.optimizer.lr == 1e-4
    assert list(two_input.optimizer.betas) == [0.9, 0.95]
    assert two_input.scheduler.min_lr_ratio * two_input.optimizer.lr == pytest.approx(1e-6)  # eta_min
    assert (two_input.dataset.batch_size, two_input.dataset.val_batch_size) == (6, 1)
    assert two_input.trainer.tf32 and not two_input.trainer.deterministic  # TF32 + cudnn.benchmark
    tabular = composed(["experiment=seed_tabular_binary"])
    assert tabular.optimizer._target_ == "torch.optim.SGD" and tabular.optimizer.lr == 0.01
    assert tabular.optimizer.momentum == 0.0 and tabular.dataset.batch_size == 10
    assert list(tabular.model.hidden_sizes) == []  # one linear layer
    lenet = composed(["experiment=seed_cifar10_lenet"])
    assert lenet.optimizer._target_ == "torch.optim.Adam" and lenet.optimizer.lr == 1e-3
    assert lenet.scheduler._target_ == "src.loop.optim.constant" and lenet.optimizer.weight_decay == 0.0
    assert (lenet.dataset.batch_size, lenet.trainer.epochs, lenet.dataset.augment) == (64, 10, False)


@pytest.mark.template  # the template's own default run (a fork makes its own the default)
def test_digits_experiment_is_the_default_run():
    assert composed(["experiment=digits_cnn"]) == composed([])


FILE_EXPERIMENTS = {  # each with its test split's size, on the small files `experiments` writes
    "mnist_cnn": ([], 12), "fashion_mnist_cnn": ([], 12),
    "cifar10_resnet18": (["dataset.verify_checksums=false"], 8),
    "seed_cifar10_lenet": (["dataset.verify_checksums=false"], 8),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> LazyRuns:
    """debug=overfit, debug=profile, and each experiment of FILE_EXPERIMENTS cut to two steps of batch 8 (debug=fast):
    one multirun (LazyRuns)."""
    root = tmp_path_factory.mktemp("presets")
    write_mnist(root / "data", "MNIST", num_train=40, num_test=12)
    write_mnist(root / "data", "FashionMNIST", num_train=40, num_test=12)
    write_cifar10(root / "data", per_batch=8)
    common = ["debug=fast", "dataset.batch_size=8", "dataset.download=false", "dataset.num_workers=0",
              "dataset.val_size=8"]
    return LazyRuns(root, {"debug=overfit": (1, ["debug=overfit"]), "debug=profile": (1, ["debug=profile"]),
                           **{name: (1, [f"experiment={name}", *common, *extra])
                              for name, (extra, _) in FILE_EXPERIMENTS.items()}})


@pytest.mark.slow  # launches training
@pytest.mark.parametrize("name", list(FILE_EXPERIMENTS))
def test_file_dataset_experiments_run_end_to_end(runs: LazyRuns, name: str):
    """The recipe itself, cut to two steps of batch 8 on small files in the real formats."""
    result = metrics(runs(name))
    assert (result["step"], result["global_batch_size"]) == (2, 8)
    assert result["val/num_samples"] == 8
    assert result["test/num_samples"] == FILE_EXPERIMENTS[name][1]
    assert 0.0 <= result["val/acc"] <= 1.0


@pytest.mark.slow  # launches training
@pytest.mark.parametrize(
    "extra,message",
    [
        ([], "error: the loss became NaN or infinite at optimizer step 2; the run stopped without saving"),
        (["callbacks.divergence.detect_anomaly=true"], "error: Function 'LogSoftmaxBackward0' returned nan values in "
                                                       "its 0th output at optimizer step 2"),
    ],
)
def test_a_diverging_loss_stops_the_run_naming_the_step(workdir: Path, extra, message):
    result = train(["optimizer=sgd", "optimizer.lr=1e30", "trainer.log_every_steps=5", "trainer.epochs=1",
                    "hydra.run.dir=run", *extra], workdir)
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(error_lines(result.stderr)) == 1 and error_lines(result.stderr)[0].startswith(message)
    assert not (workdir / "run" / "checkpoints").exists() and not (workdir / "run" / "metrics.json").exists()
