"""Benchmark: data larger than the memory of any process of the run. A whole epoch of dataset=arrow on 2 ranks.

    python benchmarks/data_memory.py                   # 4 GiB of images; writes benchmarks/DATA_MEMORY.md
    python benchmarks/data_memory.py --gib 8 --workdir /big/disk

Writes uncompressed 10 MB BMPs (3 classes) under --workdir (on disk, not a tmpfs: the page cache is what a big
dataset lives in), converts them with `python -m src.data.convert image-folder`, deletes the folder, then trains
one whole epoch of model=cnn on 12x12 random resized crops with `torchrun --nproc_per_node=2` and 2 DataLoader
workers per rank, reading every training image once. Every 0.1 s it samples RssAnon (anonymous memory) and
RssFile (pages of mapped files) of every process of the run: torchrun's agent, the ranks, their workers
(the sampler of tests/integration/test_data_cli.py). Not a test: timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "fixtures"))
from process_memory import PeakResidentMemory  # noqa: E402  (the test's sampler)

SIDE = 1824  # a square RGB BMP of 1824 pixels: 10.0 MB


def write_images(folder: Path, gib: float) -> int:
    """Uncompressed BMPs of tiled noise, shifted per image, 9 in 10 for training; returns their count."""
    count = max(30, int(gib * 2**30 / (SIDE * SIDE * 3)))
    size = SIDE * SIDE * 3
    header = b"BM" + struct.pack("<IHHI", 54 + size, 0, 0, 54) + struct.pack("<IiiHHIIiiII", 40, SIDE, SIDE, 1, 24, 0,
                                                                           size, 2835, 2835, 0, 0)
    tile = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    base = np.tile(tile, (-(-SIDE // 64), -(-SIDE // 64), 1))[:SIDE, :SIDE].copy()
    pixels = np.empty_like(base)
    for index in range(count):
        split = "val" if index % 10 == 9 else "train"
        target = folder / split / f"class{index % 3}"
        target.mkdir(parents=True, exist_ok=True)
        np.add(base, np.uint8(index * 7 % 256), out=pixels)
        with open(target / f"{index:05d}.bmp", "wb") as file:
            file.write(header)
            file.write(pixels.data)
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0, help="the data's size")
    parser.add_argument("--workdir", type=Path, default=None, help="where to write it (default: a temp dir)")
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "DATA_MEMORY.md")
    args = parser.parse_args()
    load_at_start = os.getloadavg()[0]
    workdir = Path(tempfile.mkdtemp(prefix="data_memory-", dir=args.workdir))
    try:
        count = write_images(workdir / "images", args.gib)
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "src.data.convert", "image-folder", str(workdir / "images"),
                        str(workdir / "arrow")], cwd=REPO, check=True, capture_output=True)
        convert_s = time.perf_counter() - started
        shutil.rmtree(workdir / "images")
        data_bytes = sum(file.stat().st_size for file in (workdir / "arrow").rglob("*.arrow"))
        peaks, files, summary = train(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    write_table(args, count, data_bytes, convert_s, peaks, files, summary, load_at_start)


def train(workdir: Path) -> tuple[dict[int, int], dict[int, int], dict]:
    """One epoch on 2 ranks, sampled: (peak RssAnon by pid, peak RssFile by pid, metrics.json)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(REPO / "train.py"), "dataset=arrow", f"dataset.root={workdir / 'arrow'}", "model=cnn",
               "optimizer=sgd", "dataset.batch_size=16", "dataset.image_size=[12,12]", "dataset.crop_scale=[0.35,1]",
               "dataset.num_workers=2", "trainer.epochs=1", "trainer.progress=false",
               f"hydra.run.dir={workdir / 'run'}"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    with PeakResidentMemory(process.pid, interval=0.1) as anonymous, \
            PeakResidentMemory(process.pid, interval=0.1, field="RssFile") as mapped:
        _, stderr = process.communicate()
    if process.returncode != 0:
        sys.exit(f"training failed:\n{stderr[-3000:]}")
    return anonymous.peaks, mapped.peaks, json.loads((workdir / "run" / "metrics.json").read_text())


def write_table(args, count, data_bytes, convert_s, peaks, files, summary, load_at_start) -> None:  # noqa: ANN001
    mib = 2**20
    largest = max(peaks.values()) * 1024
    lines = [
        f"# Data larger than any process's memory ({datetime.now():%Y-%m-%d}, `python benchmarks/data_memory.py "
        f"--gib {args.gib:g}`)",
        "",
        f"{count} BMPs of {SIDE}x{SIDE} RGB converted to dataset=arrow in {convert_s:.0f} s: {data_bytes / mib:,.0f} "
        "MiB of Arrow shards on disk. One epoch of model=cnn (12x12 random resized crops) on 2 ranks "
        f"(torchrun) with 2 DataLoader workers each, every training image read once: {summary['step']} steps, "
        f"{summary['samples_per_s']:.1f} samples/s, val/acc {summary['val/acc']:.3f}. "
        f"CPU load (1-minute average) at start and end: {load_at_start:.1f} and {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores.",
        "",
        "| process (pid) | peak RssAnon, MiB | peak RssFile, MiB |",
        "|---|---|---|",
        *(f"| {pid} | {peaks[pid] / 1024:,.0f} | {files.get(pid, 0) / 1024:,.0f} |" for pid in sorted(peaks)),
        "",
        "Processes in the order they started: torchrun's agent, the 2 ranks, their training workers, then their",
        "validation workers.",
        "",
        f"The data is {data_bytes / largest:.1f}x the largest anonymous memory of any process of the run "
        f"({largest / mib:,.0f} MiB); the shards' pages are mapped files (RssFile), which the kernel drops under "
        "memory pressure and reads again.",
    ]
    text = "\n".join(lines) + "\n"
    args.output.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
