"""Per-sample randomness and data larger than RAM, through the real command line.

Two on-disk datasets, written once per module:
- small: 3 classes of 16x16 PNGs (8 training images each), trained with random augmentation (RandomResizedCrop,
  flip, colour jitter) to check that augmentation follows the sample: num_workers 0 and 2 give bitwise the same run,
  and 2 ranks x 4 with sync-BN train the weights 1 process x 8 trains (within 1e-5), which a control whose
  augmentation draws per process (tests/fixtures/per_process_augmentation.py, the template before #22)
  fails;
- big: 174 uncompressed 10 MB BMPs (1.7 GB: few files, many bytes, decoded fast and resized to 12x12),
  converted with `python -m src.data.convert image-folder` into dataset=arrow. On 2 ranks with 2 workers
  each it trains, stopped mid-epoch and resumed, bitwise what dataset=image_folder trains on the same files,
  while no process of the run (torchrun's agent, the ranks, their workers) holds a third of the data's
  bytes in anonymous memory (RssAnon, sampled every 50 ms).
Runs share launches: Hydra's -m runs several jobs in one process (one import of torch), also under torchrun.
The big files go to a tmpfs (/dev/shm) when there is one, deleted at the end: this machine's disk takes
35 s to write and fsync them. Mapped from there they are shared memory (RssShmem), not anonymous memory.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import REPO, TRAIN, check, metrics, run, torchrun, train, weights
from faults import Launched
from PIL import Image
from process_memory import PeakResidentMemory

pytestmark = pytest.mark.slow

FIXTURES = str(REPO / "tests" / "fixtures")
AUGMENTED = ["model=cnn", "optimizer=sgd", "optimizer.lr=0.05", "scheduler=constant", "trainer.epochs=2",
             "dataset.batch_size=8", "dataset.image_size=[12,12]", "dataset.crop_scale=[0.35,1.0]",
             "dataset.color_jitter=0.4", "trainer.log_every_steps=2", "trainer.progress=false"]
PER_PROCESS = "per_process_augmentation.image_folder_per_process"  # the control's builder
BIG = [*AUGMENTED, "trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "dataset.num_workers=2"]
BIG_FILES, BIG_SIDE = (50, 8), 1824  # per class: train, val; a square RGB BMP of 1824 pixels: 10.0 MB


def write_small(root: Path) -> None:
    """16x16 PNGs of noise tinted per class: 8 train and 4 val images of each of 3 classes."""
    rng = np.random.default_rng(0)
    for split, count in (("train", 8), ("val", 4)):
        for label in range(3):
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True)
            for index in range(count):
                pixels = rng.integers(0, 160, (16, 16, 3)) + np.eye(3, dtype=np.int64)[label] * 90
                Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{index}.png")


def write_big(root: Path) -> None:
    """Uncompressed BMPs: PIL's header for the size, then pixels of tiled noise shifted per image."""
    header = _bmp_header(BIG_SIDE)
    tile = np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    base = np.tile(tile, (-(-BIG_SIDE // 64), -(-BIG_SIDE // 64), 1))[:BIG_SIDE, :BIG_SIDE]
    shift = 0
    for split, count in zip(("train", "val"), BIG_FILES):
        for label in range(3):
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True)
            for index in range(count):
                shift += 7
                (folder / f"{index}.bmp").write_bytes(header + (base + np.uint8(shift % 256)).tobytes())


def _bmp_header(side: int) -> bytes:
    """A 24-bit BMP's file and info headers for a square image (rows of 3 * side bytes, 4-byte aligned here)."""
    size = side * side * 3
    return b"BM" + struct.pack("<IHHI", 54 + size, 0, 0, 54) + struct.pack("<IiiHHIIiiII", 40, side, side, 1, 24, 0,
                                                                           size, 2835, 2835, 0, 0)


def write_variants(conf: Path, small: Path, big: Path) -> None:
    """Options of a `variant` group: the runs one -m launch trains, one job each."""
    variants = {
        "small": {"dataset": {"root": str(small), "num_workers": 2}},
        "small_nw0": {"dataset": {"root": str(small), "num_workers": 0}},
        "small_per_process": {"dataset": {"root": str(small), "num_workers": 2,
                                          "_target_": PER_PROCESS}},
        "big": {"dataset": {"root": str(big / "images")}, "trainer": {"limit_train_batches": 3,
                                                                      "limit_val_batches": 1}},
    }
    (conf / "variant").mkdir(parents=True)
    for name, options in variants.items():
        (conf / "variant" / f"{name}.yaml").write_text("# @package _global_\n" + yaml.safe_dump(options))


class Runs:
    """The module's launches, each started on first use."""

    def __init__(self, root: Path, big: Path) -> None:
        self.root, self.small, self.big = root, root / "small", big
        write_small(self.small)
        write_big(self.big / "images")
        result = check(run([sys.executable, "-m", "src.data.convert", "image-folder", str(self.big / "images"),
                            str(self.big / "arrow")], REPO))
        assert "train 150 rows, validation 24 rows" in result.stdout
        write_variants(root / "conf", self.small, self.big)
        self.peaks: dict[str, dict[int, int]] = {}
        self._done: set[str] = set()

    def once(self, name: str, launch) -> None:  # noqa: ANN001 - a function launching the runs of `name`
        if name not in self._done:
            launch()
            self._done.add(name)

    def one_process(self) -> Path:
        """The small data with num_workers 2 and 0, and with per-process augmentation: 3 jobs, one process."""
        sweep = self.root / "one_process"
        self.once("one_process", lambda: check(train(
            ["-m", "dataset=image_folder", *AUGMENTED, "+variant=small,small_nw0,small_per_process",
             f"hydra.searchpath=[file://{self.root / 'conf'}]", f"hydra.sweep.dir={sweep}"], self.root,
            env={"PYTHONPATH": FIXTURES})))
        return sweep

    def two_ranks(self) -> Path:
        """2 ranks, 2 workers each: the small data with per-sample and per-process augmentation, the big data."""
        sweep = self.root / "two_ranks"
        self.once("two_ranks", lambda: check(torchrun(2, [
            "-m", "dataset=image_folder", *AUGMENTED, "+variant=small,small_per_process,big",
            f"hydra.searchpath=[file://{self.root / 'conf'}]", f"hydra.sweep.dir={sweep}"], self.root,
            env={"PYTHONPATH": FIXTURES})))
        return sweep

    def arrow_resumed(self) -> Path:
        """The big data as dataset=arrow on 2 ranks: stopped after 4 of 6 steps, then resumed."""
        run_dir = self.root / "arrow_resumed"
        args = ["dataset=arrow", f"dataset.root={self.big / 'arrow'}", *BIG, f"hydra.run.dir={run_dir}"]
        self.once("arrow", lambda: [self.sampled(name, [*args, *extra]) for name, extra in
                                    (("stopped", ["trainer.max_steps=4"]), ("resumed", ["resume=auto"]))])
        return run_dir

    def sampled(self, name: str, args: list[str]) -> None:
        """torchrun of 2 ranks, its processes' RssAnon sampled while it runs."""
        launched = Launched()
        try:
            process = launched.start([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                      "--nproc_per_node=2", TRAIN, *args], self.root, logs=self.root)
            with PeakResidentMemory(process.pid) as memory:
                exit_code = process.wait(timeout=300)
        finally:
            launched.kill_all()
        assert exit_code == 0, (self.root / "launcher.err").read_text()[-3000:]
        self.peaks[name] = memory.peaks


def job(sweep: Path, *wanted: str) -> Path:
    """The job dir of a sweep whose overrides include all of `wanted`."""
    found = [path.parent.parent for path in sweep.glob("*/.hydra/overrides.yaml")
             if set(wanted) <= set(yaml.safe_load(path.read_text()))]
    assert len(found) == 1, (wanted, found)
    return found[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("data_cli")
    big = Path(tempfile.mkdtemp(prefix="data_cli-", dir="/dev/shm" if Path("/dev/shm").is_dir() else root))
    try:
        yield Runs(root, big)
    finally:
        shutil.rmtree(big, ignore_errors=True)  # 3.5 GB of images and their Arrow copy


def without_timings(summary: dict) -> dict:
    return {key: [without_timings(record) for record in value] if key == "history" else value
            for key, value in summary.items() if key not in ("epoch_time_s", "samples_per_s")}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[name].double() - b[name].double()).abs().max().item() for name in a)


def assert_bitwise(a: Path, b: Path) -> None:
    assert without_timings(metrics(a)) == without_timings(metrics(b))
    first, second = weights(a), weights(b)
    assert all(torch.equal(first[name], second[name]) for name in first), max_abs_diff(first, second)


def test_num_workers_0_and_2_train_bitwise_the_same_run(runs: Runs):
    sweep = runs.one_process()
    assert_bitwise(job(sweep, "+variant=small"), job(sweep, "+variant=small_nw0"))
    assert metrics(job(sweep, "+variant=small_nw0"))["step"] == 2 * 24 // 8


def test_two_ranks_train_the_one_process_weights_and_the_bound_catches_per_process_augmentation(runs: Runs):
    one, two = runs.one_process(), runs.two_ranks()
    ours = max_abs_diff(weights(job(one, "+variant=small")), weights(job(two, "+variant=small")))
    control = max_abs_diff(weights(job(one, "+variant=small_per_process")),
                           weights(job(two, "+variant=small_per_process")))
    assert ours < 1e-5 < control, (ours, control)


def test_arrow_on_two_ranks_stopped_and_resumed_trains_bitwise_the_image_folder_run(runs: Runs):
    resumed, folder = runs.arrow_resumed(), job(runs.two_ranks(), "+variant=big")
    log = (resumed / "train.log").read_text()
    assert "resumed from" in log and "after epoch 1, step 4 (1 steps into epoch 2)" in log
    assert metrics(resumed)["step"] == 6 and metrics(resumed)["world_size"] == 2
    assert_bitwise(resumed, folder)


def test_no_process_holds_a_third_of_the_data_in_anonymous_memory(runs: Runs):
    runs.arrow_resumed()
    data_bytes = sum(file.stat().st_size for file in (runs.big / "arrow").rglob("*.arrow"))
    for name in ("stopped", "resumed"):
        peaks = runs.peaks[name]
        assert len(peaks) >= 1 + 2 + 2 * 2, peaks  # the agent, 2 ranks, at least their training workers
        largest = max(peaks.values()) * 1024
        assert data_bytes >= 3 * largest, (name, data_bytes, largest)
    print(f"data {data_bytes / 2**20:.0f} MiB; peak RssAnon per process, MiB: "
          + json.dumps({name: sorted(kib // 1024 for kib in peaks.values()) for name, peaks in runs.peaks.items()}))


def test_a_corrupt_record_read_by_a_worker_is_one_error_line(runs: Runs, tmp_path: Path):
    """A damaged image inside a shard, read by a DataLoader worker: one line naming the file and index, exit 2."""
    arrow = tmp_path / "arrow"
    check(run([sys.executable, "-m", "src.data.convert", "image-folder", str(runs.small), str(arrow)], REPO))
    shard = arrow / "train" / "data-00000-of-00001.arrow"
    data = bytearray(shard.read_bytes())
    start = data.find((runs.small / "train" / "class1" / "2.png").read_bytes())  # sample 10 of 24
    data[start + 40 : start + 80] = bytes(40)  # inside its pixel data: the header still reads
    shard.write_bytes(bytes(data))
    result = train(["dataset=arrow", f"dataset.root={arrow}", *AUGMENTED, "dataset.num_workers=2",
                    "dataset.batch_size=24", "hydra.run.dir=corrupt"], tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, result.stderr[-3000:]
    assert error_lines[0].startswith(f"error: corrupt record 10 of {arrow / 'train'} (data-00000-of-00001.arrow "
                                     "row 10): cannot decode its image (")
    assert "Traceback" not in result.stderr
