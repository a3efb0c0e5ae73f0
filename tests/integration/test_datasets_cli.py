"""The dataset code paths through the real CLI: MNIST and CIFAR-10 files in their on-disk formats
train the same model on the device (in-memory) path and the DataLoader path, and device augmentation
replays exactly after a resume; a plain table (one column per feature) converted to dataset=arrow trains model=mlp
on its columns stacked (dataset.features=all). Those runs share one launch (LazyRuns)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import TWO_THREADS, check, metrics, torchrun, train, weights
from dataset_files import write_cifar10, write_mnist, write_noise_folder
from lazy_runs import LazyRuns

from src.data import convert

# ---- both paths through train.py -----------------------------------------------------------------

TINY_FILES_RUN = ["dataset.root=data", "dataset.download=false", "dataset.batch_size=8", "dataset.num_workers=0",
                  "dataset.val_size=8", "trainer.epochs=1", "trainer.log_every_steps=2"]


CIFAR = ["dataset=cifar10", "dataset.verify_checksums=false", *TINY_FILES_RUN]
RESUMED = [*CIFAR, "optimizer=sgd"]
RUNS: dict[str, tuple[int, list[str]]] = {  # name: (processes, overrides); LazyRuns launches them together
    **{f"mnist {in_memory}": (1, ["dataset=mnist", *TINY_FILES_RUN, f"dataset.in_memory={in_memory}"])
       for in_memory in ("true", "false")},
    **{f"cifar10 {in_memory}": (1, [*CIFAR, f"dataset.in_memory={in_memory}"]) for in_memory in ("true", "false")},
    "straight": (1, RESUMED),
    "stopped": (1, [*RESUMED, "trainer.max_steps=2"]),
    # The data page's command for a table: `python train.py dataset=arrow dataset.root=data/pq-arrow
    # dataset.features=all model=mlp`, on a table the tests write (5 epochs of 4 steps).
    "table": (1, ["dataset=arrow", "dataset.root=table", "dataset.features=all", "model=mlp", "dataset.batch_size=50",
                  "dataset.num_workers=0", "trainer.epochs=5"]),
}


def write_table(root: Path) -> None:
    """A table of 5 feature columns (float32) and a label, the sign of f0 + f1: Parquet files converted to Arrow."""
    rng = np.random.default_rng(0)
    for split, rows in (("train", 200), ("validation", 60)):
        features = rng.normal(size=(rows, 5)).astype(np.float32)
        columns = {f"f{i}": features[:, i] for i in range(5)}
        pq.write_table(pa.table({**columns, "label": (features[:, 0] + features[:, 1] > 0).astype(np.int64)}),
                       root / f"{split}.parquet")
    assert convert.main(["parquet", str(root / "train.parquet"), str(root / "validation.parquet"),
                         str(root / "table")]) == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> LazyRuns:
    root = tmp_path_factory.mktemp("datasets_cli")
    write_mnist(root / "data", "MNIST", num_train=48, num_test=20)
    write_cifar10(root / "data", per_batch=8)
    write_table(root)
    return LazyRuns(root, RUNS)


@pytest.mark.slow
def test_mnist_trains_the_same_model_on_the_device_path_and_the_dataloader_path(runs: LazyRuns):
    fast, slow = metrics(runs("mnist true")), metrics(runs("mnist false"))
    assert fast["step"] == slow["step"] == (48 - 8) // 8 and fast["val/num_samples"] == slow["val/num_samples"] == 8
    assert fast["test/num_samples"] == slow["test/num_samples"] == 20
    for key in ("train/loss", "train/acc", "val/loss", "val/acc", "test/loss", "test/acc"):
        assert fast[key] == pytest.approx(slow[key], abs=1e-5), key
    for name, tensor in weights(runs("mnist true")).items():
        torch.testing.assert_close(tensor, weights(runs("mnist false"))[name], rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("in_memory", ["true", "false"])
def test_cifar10_trains_on_both_paths(runs: LazyRuns, in_memory):
    summary = metrics(runs(f"cifar10 {in_memory}"))
    assert summary["step"] == (40 - 8) // 8 and summary["val/num_samples"] == summary["test/num_samples"] == 8
    assert np.isfinite(summary["val/loss"]) and np.isfinite(summary["train/loss"])


@pytest.mark.slow
def test_a_tables_columns_train_model_mlp_as_one_features_vector(runs: LazyRuns):
    summary, log = metrics(runs("table")), (runs("table") / "train.log").read_text()
    assert "model MLP (" in log and "200 train / 60 val samples" in log
    assert weights(runs("table"))["net.1.weight"].shape[1] == 5  # num_features: the 5 columns, stacked
    assert summary["step"] == 5 * 4 and summary["val/num_samples"] == 60
    assert summary["val/acc"] >= 0.85  # the label is a function of two of the columns: learned, not guessed
    assert summary["history"][0]["val/acc"] < summary["val/acc"]


@pytest.mark.slow
def test_cifar10_device_augmentation_replays_exactly_after_a_resume(runs: LazyRuns):
    stopped = runs("stopped")
    check(train([*RESUMED, "resume=auto", f"hydra.run.dir={stopped}"], runs.root, env=TWO_THREADS))  # as LazyRuns
    assert metrics(stopped)["step"] == (40 - 8) // 8
    for name, tensor in weights(runs("straight")).items():
        assert torch.equal(tensor, weights(stopped)[name]), name
    # Tested at step 2 when max_steps stopped it, then again at its new end: the same test as the straight run's.
    straight, resumed = metrics(runs("straight")), metrics(stopped)
    assert resumed["tested_weights"] == straight["tested_weights"], resumed["tested_weights"]
    assert {key: resumed[key] for key in resumed if key.startswith("test/")} == \
        {key: straight[key] for key in straight if key.startswith("test/")}


# ---- a damaged image in a real folder ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("launch, damaged", [("self", "train/b/2.png"), ("torchrun", "val/a/1.png")])
def test_a_damaged_image_met_by_one_rank_s_worker_ends_the_run_with_one_line_naming_it(tmp_path, launch, damaged):
    """Found by a DataLoader worker of one rank (in training, or in the val pass): that rank prints the line, its
    peer, whose collective breaks as it exits, stops quietly; exit code 2 (torchrun adds its own summary)."""
    write_noise_folder(tmp_path / "images", {damaged: "truncated"})
    args = ["dataset=image_folder", "dataset.root=images", "dataset.image_size=[8,8]", "dataset.batch_size=4",
            "dataset.num_workers=2", "model=mlp", "trainer.epochs=1", "hydra.run.dir=run"]
    result = train(["dist.nproc_per_node=2", *args], tmp_path) if launch == "self" else torchrun(2, args, tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {tmp_path / 'images' / damaged} is not a readable image (OSError: image file is "
                      "truncated): replace or remove it (python -m src.data.convert check-images ROOT lists every "
                      "such file)"], result.stderr[-3000:]
    assert "Error executing job" not in result.stderr and "Connection closed" not in result.stderr
    if launch == "self":
        assert result.returncode == 2 and "Traceback" not in result.stderr
