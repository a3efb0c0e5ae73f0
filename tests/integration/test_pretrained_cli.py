"""Pretrained backbones through the real CLI, offline: a timm model's weights saved to a file, and a torchvision
model's file placed under TORCH_HOME, train from exactly those weights (every backbone parameter equal; the head new
and of the task's width) on 1 process and 2 ranks with the weights' own normalisation; eval.py rebuilds the model
without its weights file; learning rates per parameter group survive a resume bitwise; a segmentation model's mIoU
is the same on 1, 2 and 3 ranks of eval.py as a standalone recomputation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
import torchvision
from conftest import REPO, check, copy_run, metrics, run, torchrun, train, weights
from dataset_files import write_noise_folder
from lazy_runs import LazyRuns
from safetensors.torch import save_file

pytestmark = pytest.mark.slow

EVAL = str(REPO / "eval.py")
TIMM = "test_efficientnet.r160_in1k"  # a tiny timm model with ImageNet weights' statistics and a 160x160 input
FROZEN = ["optimizer.lr=0", "trainer.epochs=1", "dataset.batch_size=4", "dataset.num_workers=0",
          "dataset.augment=false"]


def parameters(state: dict[str, torch.Tensor], skip: str) -> dict[str, torch.Tensor]:
    """The learnable tensors (BatchNorm statistics left out: training updates them at any lr), but the head's."""
    return {key: value for key, value in state.items()
            if not key.startswith(skip) and "running_" not in key and "num_batches" not in key}


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("images")
    write_noise_folder(root, {})
    return root


def timm_weights(name: str) -> dict[str, torch.Tensor]:
    """timm's `name` as seeded here: the weights a test saves to a file as if downloaded."""
    torch.manual_seed(0)
    return timm.create_model(name).state_dict()


LR_GROUPS = ["model=mlp", "optimizer=adamw", 'optimizer.lr_multipliers={*:0.1,net.7:1.0}', "trainer.epochs=2",
             "trainer.log_every_steps=5"]
SEGMENTATION = ["experiment=segment_shapes", "dataset.num_train=64", "dataset.num_val=40", "dataset.num_test=24",
                "dataset.batch_size=16", "trainer.epochs=1"]


def timm_images(images: Path) -> list[str]:
    """The frozen-backbone test's model and data."""
    return ["model=timm", f"model.name={TIMM}", "dataset=image_folder", f"dataset.root={images}",
            "dataset.batch_size=4", "dataset.num_workers=0", "trainer.epochs=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, images: Path) -> LazyRuns:
    """The runs the tests read, launched together on first use by number of processes (LazyRuns), on one thread per
    process (conftest's default, as the evaluations and resumes of them run); each run that reads a weights file has
    its own (in the root), which its test may remove."""
    root = tmp_path_factory.mktemp("pretrained")
    for name in ("timm_on_1", "timm_on_2", "probe"):
        save_file(timm_weights(TIMM), str(root / f"{name}.safetensors"))
    save_file(timm_weights("test_resnet.r160_in1k"), str(root / "finetune.safetensors"))
    timm_run = ["dataset=image_folder", f"dataset.root={images}", "model=timm", f"model.name={TIMM}", *FROZEN]
    return LazyRuns(root, {
        **{f"timm on {n}": (n, [*timm_run, f"model.pretrained={root / f'timm_on_{n}.safetensors'}"]) for n in (1, 2)},
        "lr groups": (1, LR_GROUPS),
        "lr groups stopped": (1, [*LR_GROUPS, "trainer.max_steps=7"]),
        "segmentation": (1, SEGMENTATION),
        # experiment=finetune_timm as the README gives it, on a tiny resnet (its head is `fc`, as resnet50's).
        "finetune": (1, ["experiment=finetune_timm", f"dataset.root={images}", "model.name=test_resnet.r160_in1k",
                         f"model.pretrained={root / 'finetune.safetensors'}", "dataset.batch_size=4",
                         "dataset.num_workers=0", "trainer.epochs=2"]),
        "probe": (1, [*timm_images(images), f"model.pretrained={root / 'probe.safetensors'}",
                      "trainer.freeze=[conv_stem,bn1,blocks]"]),
    }, env={"OMP_NUM_THREADS": "1"})


def train_log(run_dir: Path) -> str:
    return (run_dir / "train.log").read_text()


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_timm_model_trains_from_its_weights_file_normalised_as_they_were_trained(runs, tmp_path, nproc):
    reference, run_dir = timm_weights(TIMM), runs(f"timm on {nproc}")
    weights_file = runs.root / f"timm_on_{nproc}.safetensors"
    assert metrics(run_dir)["world_size"] == nproc
    trained = weights(run_dir)
    assert trained["classifier.weight"].shape[0] == 2 and reference["classifier.weight"].shape[0] == 1000
    expected = parameters(reference, "classifier.")
    assert parameters(trained, "classifier.").keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(trained[name], tensor), name
    log = train_log(run_dir)
    assert "images resized to 160x160, normalised with mean [0.485, 0.456, 0.406] and std [0.229, 0.224, 0.225]" in log
    assert f"model: timm {TIMM} with pretrained weights (file {weights_file}); new head " \
           "classifier (Linear(in_features=256, out_features=2" in log
    weights_file.unlink()  # eval.py rebuilds the model from the checkpoint alone
    check(run([sys.executable, EVAL, f"checkpoint={run_dir / 'checkpoints' / 'last.pt'}", "split=val"], tmp_path))
    evaluated = metrics(next((tmp_path / "outputs" / "eval").glob("*/*")))
    assert evaluated["val/acc"] == metrics(run_dir)["val/acc"]


def test_a_torchvision_model_loads_the_file_placed_in_torch_home(images, tmp_path):
    torch.manual_seed(0)
    reference = torchvision.models.resnet18().state_dict()
    cache = tmp_path / "torch" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    torch.save(reference, cache / "resnet18-f37072fd.pth")
    args = ["dataset=image_folder", f"dataset.root={images}", "dataset.image_size=[32,32]", "model=torchvision",
            "model.name=resnet18", "model.weights=IMAGENET1K_V1", *FROZEN, "hydra.run.dir=run"]
    check(train(args, tmp_path, env={"TORCH_HOME": str(tmp_path / "torch")}))
    trained = weights(tmp_path / "run")
    assert trained["fc.weight"].shape == (2, 512)
    for name, tensor in parameters(reference, "fc.").items():
        assert torch.equal(trained[name], tensor), name
    # The size set on the command line wins over the weights' 224; their mean and std are kept.
    assert "images resized to 32x32, normalised with mean [0.485, 0.456, 0.406] and std [0.229, 0.224, 0.225]" \
        in train_log(tmp_path / "run")


def test_learning_rates_per_parameter_group_survive_a_resume_bitwise(runs, tmp_path):
    copy_run(runs("lr groups stopped"), tmp_path / "resumed")
    check(train([*LR_GROUPS, "resume=auto", "hydra.run.dir=resumed"], tmp_path))
    straight, resumed = (torch.load(path / "checkpoints" / "last.pt", weights_only=False)
                         for path in (runs("lr groups"), tmp_path / "resumed"))
    for name, tensor in weights(runs("lr groups")).items():
        assert torch.equal(weights(tmp_path / "resumed")[name], tensor), name
    groups = straight["optimizers"]["model"]["param_groups"]
    assert sorted({(round(group["initial_lr"], 12), group["weight_decay"]) for group in groups}) == [
        (3e-4, 0.0), (3e-4, 0.05), (3e-3, 0.0), (3e-3, 0.05)]
    assert [g["lr"] for g in groups] == [g["lr"] for g in resumed["optimizers"]["model"]["param_groups"]]
    assert "under *: lr x0.1" in train_log(runs("lr groups"))


@pytest.fixture(scope="module")
def segmentation_run(runs: LazyRuns) -> tuple[Path, float, float]:
    """The checkpoint of a 1-epoch segmentation run, and its val mIoU and pixel accuracy computed standalone."""
    checkpoint = runs("segmentation") / "checkpoints" / "last.pt"
    expected = subprocess.run([sys.executable, "-c", STANDALONE, str(checkpoint)], cwd=REPO, capture_output=True,
                              text=True, timeout=300)
    assert expected.returncode == 0, expected.stderr[-2000:]
    miou, pixel_acc = (float(x) for x in expected.stdout.split())
    return checkpoint, miou, pixel_acc


@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_segmentation_miou_in_eval_is_the_standalone_miou_on_any_world_size(segmentation_run, nproc, tmp_path):
    checkpoint, miou, pixel_acc = segmentation_run
    args = [f"checkpoint={checkpoint}", "split=val", "dataset.val_batch_size=6"]  # 40 masks: uneven shards
    check(run([sys.executable, EVAL, *args], tmp_path) if nproc == 1 else torchrun(nproc, args, tmp_path, EVAL))
    evaluated = metrics(next((tmp_path / "outputs" / "eval").glob("*/*")))
    assert evaluated["world_size"] == nproc
    assert evaluated["val/miou"] == pytest.approx(miou, abs=1e-6)
    assert evaluated["val/acc"] == pytest.approx(pixel_acc, abs=1e-6)


# mIoU from a confusion matrix of every val pixel, with the model load_trained gives and the dataset built alone.
STANDALONE = """
import sys, torch
from src.checkpoint.trained import load_trained
from src.components.datasets import shapes
model, config = load_trained(sys.argv[1])
data = config["dataset"]
splits = shapes(num_train=data["num_train"], num_val=data["num_val"], num_test=data["num_test"],
                image_size=data["image_size"], flip=data["flip"], mean=data["mean"], std=data["std"], seed=data["seed"])
images = torch.stack([splits.val[i][0] for i in range(len(splits.val))])
masks = torch.stack([splits.val[i][1] for i in range(len(splits.val))])
with torch.no_grad():
    predicted = model(images).argmax(1)
classes = 4
confusion = torch.bincount(masks.flatten() * classes + predicted.flatten(), minlength=classes ** 2).view(classes, -1)
inter, union = confusion.diag().double(), (confusion.sum(0) + confusion.sum(1) - confusion.diag()).double()
present = union > 0
print((inter[present] / union[present]).mean().item(), (confusion.diag().sum() / confusion.sum()).item())
"""


def test_a_frozen_pretrained_backbone_stays_its_file_and_init_from_starts_a_run_from_the_fine_tuned_one(images,
                                                                                                        runs, tmp_path):
    reference, probed = timm_weights(TIMM), weights(runs("probe"))
    for name, tensor in parameters(reference, "classifier.").items():
        if not name.startswith(("conv_head", "bn2")):  # the layers after the frozen blocks train
            assert torch.equal(probed[name], tensor), name
    assert not torch.equal(probed["conv_head.weight"], reference["conv_head.weight"])
    check(train([*timm_images(images), f"init_from={runs('probe') / 'checkpoints' / 'last.pt'}", "optimizer.lr=0",
                 "hydra.run.dir=second"], tmp_path))
    second = weights(tmp_path / "second")
    for name, tensor in parameters(probed, "").items():
        assert torch.equal(second[name], tensor), name


def test_the_fine_tuning_recipe_trains_a_pretrained_timm_model_from_its_file(runs):
    """experiment=finetune_timm as the README gives it, on a tiny resnet (its head is `fc`, as resnet50's)."""
    reference = timm_weights("test_resnet.r160_in1k")
    log, summary = train_log(runs("finetune")), metrics(runs("finetune"))
    assert "images resized to 160x160, normalised with mean [0.5, 0.5, 0.5] and std [0.5, 0.5, 0.5]" in log
    assert "tensors under *: lr x0.1" in log and "tensors under fc: lr x1.0" in log and ", no weight decay" in log
    assert summary["step"] == 2 * 8 // 4 and summary["world_size"] == 1
    trained = weights(runs("finetune"))
    assert trained["fc.weight"].shape[0] == 2
    moved = [name for name, tensor in parameters(reference, "fc.").items() if not torch.equal(trained[name], tensor)]
    assert moved  # the backbone trains, at a tenth of the head's rate
