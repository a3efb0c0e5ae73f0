"""Fine-tuning and early stopping on the real command line: `init_from` starts a fresh run from another
run's model weights (a new head where the class count differs), `trainer.freeze` keeps a backbone
bitwise unchanged (linear probing), and `callbacks.early_stopping` ends a plateaued run at the same epoch on
every rank, for good: `resume=auto` afterwards trains no more."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import check, copy_run, metrics, torchrun, train, weights

pytestmark = pytest.mark.slow

# 4 classes of synthetic 8x8 images: the digits CNN's backbone and hidden layer fit, its 10-class head does not.
SYNTHETIC_4 = ["dataset=synthetic", "dataset.num_classes=4", "dataset.image_size=[8,8]", "dataset.num_train=256",
               "dataset.num_val=128", "dataset.batch_size=64"]
HEAD = ("classifier.5.weight", "classifier.5.bias")
SHAPE_LINE = ("init_from: 2 shape differs (fresh initialisation kept): classifier.5.weight file[10, 128] "
              "model[4, 128], classifier.5.bias file[10] model[4]")


def parameters(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """The learnable tensors of a SimpleCNN state_dict (BatchNorm's running statistics left out: training
    updates them whatever the optimizer does), those whose names start with `prefix`."""
    return {key: value for key, value in state.items()
            if key.startswith(prefix) and "running_" not in key and "num_batches" not in key}


def assert_equal(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert ours and set(ours) == set(theirs)
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), key


@pytest.fixture(scope="module")
def workdir_with_a_source(one_epoch_run: Path, tmp_path_factory) -> Path:
    """A launch directory holding `source/`: one epoch of the default digits run."""
    workdir = tmp_path_factory.mktemp("finetune")
    copy_run(one_epoch_run, workdir / "source")
    return workdir


def test_finetune_into_four_classes_reinitialises_the_head_and_probes_linearly(workdir_with_a_source: Path):
    """The README's fine-tuning command, scaled down, as a linear probe: the backbone frozen."""
    workdir = workdir_with_a_source
    source = weights(workdir / "source")
    result = check(train(["init_from=source/checkpoints/last.pt", "init_from_strict=false", *SYNTHETIC_4,
                          "trainer.freeze=[features]", "trainer.epochs=1", "hydra.run.dir=probe"], workdir))
    assert "init_from: loaded 14 of the model's 16 tensors from source/checkpoints/last.pt" in result.stdout
    assert SHAPE_LINE in result.stdout
    assert "(150,628 parameters, 131,716 trainable, 18,912 frozen)" in result.stdout
    summary = metrics(workdir / "probe")
    assert summary["frozen_parameters"] == 18_912 and summary["epoch"] == 1 and summary["step"] == 4
    assert math.isfinite(summary["train/loss"]) and math.isfinite(summary["val/loss"])
    probe = weights(workdir / "probe")
    assert_equal(parameters(probe, "features."), parameters(source, "features."))  # bitwise, after training
    assert probe["classifier.5.weight"].shape == (4, 128)
    assert not torch.equal(probe["classifier.2.weight"], source["classifier.2.weight"])  # the rest trained


def test_init_from_loads_the_matching_weights_exactly_and_keeps_a_fresh_head(workdir_with_a_source: Path):
    """At step 0 (lr=0: one step changes no parameter) the run holds the file's weights where they fit,
    and where they do not, the very tensors a run without init_from starts from."""
    workdir = workdir_with_a_source
    source = weights(workdir / "source")
    # A plain state_dict as another tool saves it: DDP's prefix, the old head dropped, a key of its own.
    plain = {f"module.{key}": value for key, value in source.items() if key not in HEAD}
    torch.save({**plain, "module.aux.weight": torch.zeros(3)}, workdir / "plain.pt")
    step_0 = [*SYNTHETIC_4, "optimizer.lr=0", "trainer.max_steps=1"]
    result = check(train(["init_from=plain.pt", "init_from_strict=false", *step_0, "hydra.run.dir=plain"], workdir))
    check(train([*step_0, "hydra.run.dir=fresh"], workdir))
    for line in ("init_from: loaded 14 of the model's 16 tensors from plain.pt",
                 "init_from: 2 missing from the file (fresh initialisation kept): classifier.5.weight, "
                 "classifier.5.bias", "init_from: 1 unexpected in the file (ignored): aux.weight"):
        assert line in result.stdout
    loaded, fresh = weights(workdir / "plain"), weights(workdir / "fresh")
    assert_equal(parameters(loaded, "features."), parameters(source, "features."))
    assert_equal(parameters(loaded, "classifier.2."), parameters(source, "classifier.2."))
    assert_equal(parameters(loaded, "classifier.5."), parameters(fresh, "classifier.5."))
    assert not torch.equal(fresh["features.0.weight"], source["features.0.weight"])
    assert torch.load(workdir / "plain" / "checkpoints" / "last.pt", weights_only=True)["loop"]["step"] == 1  # fresh


def test_strict_init_from_refuses_another_head(workdir_with_a_source: Path):
    result = train(["init_from=source/checkpoints/last.pt", *SYNTHETIC_4, "hydra.run.dir=strict"],
                   workdir_with_a_source)
    assert result.returncode == 2
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "does not fit the model (2 shape differs: classifier.5.weight file[10, 128] model[4, 128]" in error
    assert "pass init_from_strict=false" in error
    assert not (workdir_with_a_source / "strict").exists()


def test_init_from_applies_to_a_fresh_start_only(workdir_with_a_source: Path):
    """With resume=auto and a checkpoint in the run dir (a restarted worker's case too), the run resumes."""
    workdir = workdir_with_a_source
    shutil.copytree(workdir / "source", workdir / "resumable")
    before = (workdir / "resumable" / "checkpoints" / "last.pt").read_bytes()
    result = check(train(["init_from=source/checkpoints/last.pt", "resume=auto", "trainer.epochs=1",
                          "hydra.run.dir=resumable"], workdir))
    assert "init_from=source/checkpoints/last.pt not applied: the run resumes from " in result.stdout
    assert "init_from: loaded" not in result.stdout
    assert (workdir / "resumable" / "checkpoints" / "last.pt").read_bytes() == before  # its 1 epoch was done


# 2 steps an epoch; val/acc cannot improve by more than 1.0 after epoch 1, so patience=2 ends epoch 3.
PLATEAU = ["trainer.epochs=10", "trainer.limit_train_batches=2", "callbacks.early_stopping.patience=2",
           "callbacks.early_stopping.min_delta=1.0"]


@pytest.mark.parametrize("processes", [1, 2])
def test_early_stopping_ends_every_rank_at_the_same_epoch_for_good(tmp_path: Path, processes: int):
    def launch(args: list[str]):
        return check(train(args, tmp_path) if processes == 1 else torchrun(2, args, tmp_path))

    launch([*PLATEAU, "hydra.run.dir=run"])
    run_dir = tmp_path / "run"
    summary = metrics(run_dir)
    assert (summary["stop_reason"], summary["stopped_at_epoch"], summary["epoch"]) == ("early_stopped", 3, 3)
    assert summary["world_size"] == processes and len(summary["history"]) == 3 and summary["step"] == 6
    logs = [run_dir / "train.log", *[run_dir / f"train.rank{rank}.log" for rank in range(1, processes)]]
    for log in logs:  # each rank decided at the same epoch
        text = log.read_text()
        assert "early stopping after epoch 3: val/acc has not improved by more than 1 for 2 epochs" in text, log
        assert "epoch 4/10" not in text
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["loop"]
    assert (saved["epoch"], saved["ended"]["reason"], saved["ended"]["epoch"]) == (3, "early_stopped", 3)
    files = {p: p.read_bytes() for p in [run_dir / "metrics.json", run_dir / "checkpoints" / "last.pt"]}

    launch([*PLATEAU, "resume=auto", "hydra.run.dir=run"])
    assert {p: p.read_bytes() for p in files} == files  # nothing trained, nothing rewritten
    for log in logs:
        assert "early stopping had ended this run after epoch 3: nothing more to train" in log.read_text(), log
