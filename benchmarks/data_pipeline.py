"""Benchmark: does the input pipeline keep up? The template trained from files against a bare DataLoader loop.

    python benchmarks/data_pipeline.py                  # 3 repeats, writes benchmarks/DATA_PIPELINE.md
    python benchmarks/data_pipeline.py --repeats 5 --images 4096
    python benchmarks/data_pipeline.py --cases image_folder:2 arrow:2   # some of the cases (DATA:WORKERS)

Writes an image folder of 64x64 PNGs (4 classes) and its `python -m src.data.convert` copy, then trains the same
CNN (model=cnn, 16x16 inputs, RandomResizedCrop + flip, SGD, global batch 64) from each format with num_workers 0
and 2: the template (`train.py`: per-sample seeding, the global-batch sampler, validation every epoch) and
`benchmarks/bare_data_loop.py` (a plain DataLoader loop over the same files, decode and transforms), interleaved
(template, bare, template, bare, ...), median of the repeats, training samples/s. It also measures what bounds
a worker: PIL's raw decode rate on the same files, and decode + transforms, in one process.
Not a test: numbers on a shared machine are noisy; only ratios measured in one run mean much.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

IMAGE_SIZE, CROP = 16, ("0.35", "1.0")




def run_checked(command: list[str], env: dict[str, str] | None = None) -> str:
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                            env=None if env is None else {**os.environ, **env})
    if result.returncode != 0:
        sys.exit(f"benchmark command failed ({result.returncode}): {' '.join(command)}\n{result.stderr[-3000:]}")
    return result.stdout


def write_images(folder: Path, count: int) -> None:
    """64x64 RGB PNGs of noise tinted per class (about 12 KB each), 4 classes; a tenth as many for val."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", count), ("val", max(4, count // 10))):
        for index in range(n):
            label = index % 4
            folder_path = folder / split / f"class{label}"
            folder_path.mkdir(parents=True, exist_ok=True)
            pixels = rng.integers(0, 192, (64, 64, 3)) + np.eye(4, 3, dtype=np.int64)[label] * 63
            Image.fromarray(pixels.astype(np.uint8)).save(folder_path / f"{index:06d}.png")


def template(dataset: str, root: Path, workers: int, epochs: int, workdir: Path) -> tuple[float, float]:
    """The template's training samples/s and its last epoch's train loss."""
    run_dir = workdir / f"run-{time.time_ns()}"
    run_checked([sys.executable, str(REPO / "train.py"), f"dataset={dataset}", f"dataset.root={root}", "model=cnn",
                 "optimizer=sgd", "dataset.batch_size=64", f"dataset.num_workers={workers}",
                 f"dataset.image_size=[{IMAGE_SIZE},{IMAGE_SIZE}]", f"dataset.crop_scale=[{CROP[0]},{CROP[1]}]",
                 f"trainer.epochs={epochs}", "trainer.progress=false", f"hydra.run.dir={run_dir}"])
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return metrics["samples_per_s"], metrics["train/loss"]


def bare(dataset: str, root: Path, workers: int, epochs: int, env: dict[str, str] | None = None) -> tuple[float, float]:
    """The bare loop's training samples/s and its last epoch's mean loss."""
    stdout = run_checked([sys.executable, str(REPO / "benchmarks" / "bare_data_loop.py"), "--format", dataset,
                          "--root", str(root), "--num-workers", str(workers), "--epochs", str(epochs),
                          "--image-size", str(IMAGE_SIZE), "--crop-scale", *CROP], env)
    report = json.loads(stdout.strip().splitlines()[-1])
    return report["samples_per_s"], report["loss"]


def decode_rates(folder: Path) -> tuple[float, float]:
    """Images/s in one process: PIL's decode to RGB alone, and decode + the training transforms."""
    code = f"""
import sys, time
from pathlib import Path
from PIL import Image
sys.path.insert(0, {str(REPO)!r})
from src.components.datasets import image_transforms
files = sorted(Path({str(folder)!r}).rglob("*.png"))
transform = image_transforms(({IMAGE_SIZE}, {IMAGE_SIZE}), 3, True, ({CROP[0]}, {CROP[1]}), 0.0)[0]
def rate(work):
    started = time.perf_counter()
    for file in files:
        work(file)
    return len(files) / (time.perf_counter() - started)
decode = lambda file: Image.open(file).convert("RGB")
rate(decode)  # warm the page cache
print(rate(decode), rate(lambda file: transform(decode(file))))
"""
    raw, transformed = (float(x) for x in run_checked([sys.executable, "-c", code]).split())
    return raw, transformed


LOADERS = """
import statistics, sys, time
import torch
from torch.utils.data import DataLoader
sys.path.insert(0, {repo!r})
from src.components import datasets
from src.data.loaders import GlobalBatchSampler, make_loader
build = getattr(datasets, {dataset!r})
train = build({root!r}, image_size=({size}, {size}), crop_scale=({crop0}, {crop1})).train
sampler = GlobalBatchSampler(len(train), 64, 0, 1, seed=0)
ours = make_loader(train, sampler, torch.device("cpu"), {workers}, seed=0, augment=True)
bare = DataLoader(train, batch_size=64, shuffle=True, drop_last=True, num_workers={workers},
                  persistent_workers={workers} > 0)
def epoch(loader):
    started, samples = time.perf_counter(), 0
    for images, labels in loader:
        samples += len(labels)
    return samples / (time.perf_counter() - started)
rates = {{"ours": [], "bare": []}}
for round in range({rounds}):  # interleaved epochs; the first of each warms up (workers start)
    sampler.set_epoch(round)
    rates["ours"].append(epoch(ours))
    rates["bare"].append(epoch(bare))
print(statistics.median(rates["ours"][1:]), statistics.median(rates["bare"][1:]))
"""


def loader_rates(dataset: str, root: Path, workers: int, rounds: int) -> tuple[float, float]:
    """Samples/s of the template's loader and of a plain DataLoader over the same data, fetching only (no
    training), epochs interleaved in one process: what the per-sample seeding and keys cost."""
    code = LOADERS.format(repo=str(REPO), dataset=dataset, root=str(root), size=IMAGE_SIZE, crop0=CROP[0],
                          crop1=CROP[1], workers=workers, rounds=rounds)
    ours, bare_rate = (float(x) for x in run_checked([sys.executable, "-c", code]).split())
    return ours, bare_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--images", type=int, default=2048, help="training images (val: a tenth)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--cases", nargs="+", default=["image_folder:0", "image_folder:2", "arrow:0", "arrow:2"],
                        metavar="DATA:WORKERS", help="which data (image_folder, arrow) with how many workers")
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "DATA_PIPELINE.md")
    args = parser.parse_args()
    load_at_start = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        write_images(workdir / "images", args.images)
        run_checked([sys.executable, "-m", "src.data.convert", "image-folder", str(workdir / "images"),
                     str(workdir / "arrow")])
        roots = {"image_folder": workdir / "images", "arrow": workdir / "arrow"}
        for dataset, workers in (case.split(":") for case in args.cases):
            ours, theirs = [], []
            for _ in range(args.repeats):  # interleaved: a busy moment slows all alike
                ours.append(template(dataset, roots[dataset], int(workers), args.epochs, workdir))
                theirs.append(bare(dataset, roots[dataset], int(workers), args.epochs))
            print(dataset, workers, ours, theirs, flush=True)
            fetch = loader_rates(dataset, roots[dataset], int(workers), rounds=1 + 2 * args.repeats)
            rows.append((dataset, int(workers), ours, theirs, *fetch))
        raw, transformed = decode_rates(workdir / "images" / "train")
    write_table(args, rows, raw, transformed, load_at_start)


def write_table(args: argparse.Namespace, rows: list, raw: float, transformed: float, load_at_start: float) -> None:
    lines = [
        f"# Input pipeline ({datetime.now():%Y-%m-%d}, `python benchmarks/data_pipeline.py --repeats {args.repeats} "
        f"--images {args.images} --epochs {args.epochs}`)",
        "",
        f"{args.images} training PNGs of 64x64 (4 classes), model=cnn on {IMAGE_SIZE}x{IMAGE_SIZE} random resized "
        "crops (scale 0.35-1) with flips, SGD, global batch 64, "
        f"{args.epochs} epochs; training samples/s, median of {args.repeats}, template and bare loops interleaved.",
        f"CPU load (1-minute average) at start and end: {load_at_start:.1f} and {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores; above about 1, other work shared the CPU and the numbers are noisier.",
        "",
        "Fetch only: the template's loader (per-sample seeding, (epoch, index) keys) and a plain DataLoader over the",
        "same dataset, iterated without training, epochs interleaved in one process (median after a warm-up epoch).",
        "",
        "Both loops train the same way (SGD with the template's default schedule: one epoch of warmup, then cosine);",
        "the last column shows each one's final train loss (median), so a baseline that stopped learning would show.",
        "Both run with the C library's allocator as it comes (the template tunes none).",
        "",
        "| data | num_workers | template samples/s | bare loop samples/s | template / bare "
        "| fetch only: template / plain DataLoader | samples/s per worker / PIL "
        "decode + transforms | final train loss: template, bare |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for dataset, workers, ours, theirs, fetch_ours, fetch_bare in rows:
        rate, bare_rate = (statistics.median(r for r, _ in runs) for runs in (ours, theirs))
        per_worker = f"{rate / workers / transformed:.3f}" if workers else "(main process)"
        losses = statistics.median(loss for _, loss in ours), statistics.median(loss for _, loss in theirs)
        lines.append(f"| {dataset} | {workers} | {rate:.0f} | {bare_rate:.0f} | {rate / bare_rate:.3f} | "
                     f"{fetch_ours / fetch_bare:.3f} ({fetch_ours:.0f} / {fetch_bare:.0f}) | {per_worker} | "
                     f"{losses[0]:.2g}, {losses[1]:.2g} |")
    lines += ["", "Every repeat, template / bare samples/s, in the order run:"]
    for dataset, workers, ours, theirs, *_ in rows:
        runs = ", ".join(f"{a:.0f}/{b:.0f}" for (a, _), (b, _) in zip(ours, theirs))
        lines.append(f"- {dataset}, {workers} workers: {runs}")
    lines += [
        "",
        f"The limit, measured in one process on the same files: PIL decodes {raw:.0f} images/s (`Image.open(...)."
        f"convert('RGB')`), {transformed:.0f}/s with the training transforms. A worker cannot deliver more; "
        "with 2 workers and the training step sharing 2 cores, each delivers less.",
    ]
    text = "\n".join(lines) + "\n"
    args.output.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
