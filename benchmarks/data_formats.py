"""Benchmark: random-access reads of one image dataset in the disk-backed formats `dataset=arrow` was chosen from.

    python benchmarks/data_formats.py --hf-python VENV/bin/python --wids-path VENV/lib/python3.11/site-packages

Writes N PNGs (64x64 RGB noise, ~12 KB each), then the same files as:
- the Arrow layout of `datasets`' save_to_disk, written by `python -m src.data.convert image-folder`, read two
  ways: with pyarrow alone (`src/data/arrow_files.py`, what dataset=arrow does) and with `datasets.load_from_disk`
  (`--hf-python`: an interpreter with `datasets` installed, e.g. a throwaway venv);
- tar shards with a wids index, read with `wids.ShardListDataset` in place (`--wids-path`: a site-packages
  holding wids; it imports torch, so it runs in this interpreter).
Each reader fetches the encoded bytes of the same random indices in a fresh process (no decode: that cost is
the same for all), median of the repeats; the import is timed in fresh processes too. Writes the table to
benchmarks/DATA_FORMATS.md. Not a test: numbers on a shared machine are noisy, compare the ratios.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

READERS = {  # name: (what it imports, code that defines `read(i) -> bytes` given DIR, the dataset folder)
    "pyarrow (src/data/arrow_files.py)": ("import pyarrow", """
from pathlib import Path
from src.data.arrow_files import ArrowSplit
split = ArrowSplit(Path(DIR) / "arrow" / "train")
read = lambda i: split.values(i, ["image"])[0][0]
"""),
    "datasets.load_from_disk": ("import datasets", """
import datasets
ds = datasets.load_from_disk(DIR + "/arrow")["train"].cast_column("image", datasets.Image(decode=False))
read = lambda i: ds[i]["image"]["bytes"]
"""),
    "wids.ShardListDataset (tar shards)": ("import wids", """
import json, wids
shards = json.load(open(DIR + "/wids.json"))["shardlist"]
ds = wids.ShardListDataset(shards, localname=lambda url: url, transformations=[])
read = lambda i: ds[i][".png"].getvalue()
"""),
}

TIMED_READS = """
import random, sys, time
order = random.Random(0).sample(range(N), min(N, 3000))
assert isinstance(read(order[0]), bytes)
started = time.perf_counter()
total = sum(len(read(i)) for i in order)
print(len(order) / (time.perf_counter() - started))
"""


def write_images(folder: Path, count: int) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", count), ("val", max(1, count // 10))):
        for label in range(2):
            (folder / split / f"c{label}").mkdir(parents=True)
        for index in range(n):
            pixels = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / split / f"c{index % 2}" / f"{index:06d}.png")


def write_wids(folder: Path, images: Path, shards: int = 4) -> None:
    """tar shards of the train images (key.png, key.cls), and the wids JSON index naming them."""
    files = sorted((images / "train").rglob("*.png"))
    listing = []
    for shard in range(shards):
        part = files[shard::shards]
        path = folder / f"train-{shard}.tar"
        with tarfile.open(path, "w") as tar:
            for file in part:
                for suffix, data in ((".png", file.read_bytes()), (".cls", file.parent.name[1:].encode())):
                    info = tarfile.TarInfo(f"{file.parent.name}_{file.stem}{suffix}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        listing.append({"url": str(path), "nsamples": len(part)})
    (folder / "wids.json").write_text(json.dumps({"__kind__": "wids-shard-index-v1", "shardlist": listing}))


def run(python: str, code: str, env: dict[str, str]) -> str:
    result = subprocess.run([python, "-c", code], cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"benchmark command failed: {python} -c ...\n{result.stderr[-3000:]}")
    return result.stdout.strip().splitlines()[-1]


def import_seconds(python: str, statement: str, env: dict[str, str], repeats: int) -> float:
    """Median wall time of a fresh interpreter that runs `statement`, minus that of an empty one."""
    def timed(code: str) -> float:
        started = time.perf_counter()
        run(python, code + "\nprint(0)", env)
        return time.perf_counter() - started

    return statistics.median(timed(statement) - timed("pass") for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf-python", help="an interpreter with `datasets` installed (skipped without)")
    parser.add_argument("--wids-path", help="a site-packages folder holding wids (skipped without)")
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "DATA_FORMATS.md")
    args = parser.parse_args()
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_images(folder / "images", args.images)
        subprocess.run([sys.executable, "-m", "src.data.convert", "image-folder", str(folder / "images"),
                        str(folder / "arrow")], cwd=REPO, check=True, capture_output=True)
        write_wids(folder, folder / "images")
        interpreters = {"pyarrow (src/data/arrow_files.py)": (sys.executable, {}),
                        "datasets.load_from_disk": (args.hf_python, {}),
                        "wids.ShardListDataset (tar shards)": (sys.executable, {"PYTHONPATH": args.wids_path or ""})}
        readers = {name: (*interpreters[name], statement, setup) for name, (statement, setup) in READERS.items()
                   if interpreters[name][0] is not None and not (name.startswith("wids") and not args.wids_path)}
        reads = {name: [] for name in readers}
        for _ in range(args.repeats):  # interleaved: a busy moment slows every reader alike
            for name, (python, env, _, setup) in readers.items():
                code = f"DIR = {str(folder)!r}\nN = {args.images}\n{setup}\n{TIMED_READS}"
                reads[name].append(float(run(python, code, env)))
        rows = [(name, statistics.median(reads[name]), import_seconds(python, statement, env, args.repeats))
                for name, (python, env, statement, _) in readers.items()]
    best = max(reads for _, reads, _ in rows)
    lines = [
        f"# Disk-backed formats: random reads ({datetime.now():%Y-%m-%d}, `python benchmarks/data_formats.py "
        f"--images {args.images} --repeats {args.repeats}`)",
        "",
        f"{args.images} PNGs of 64x64 RGB noise (~12 KB each), the encoded bytes of 3000 random indices read in a",
        "fresh process (page cache warm: the files were just written), median of the repeats; import: a fresh",
        "interpreter importing the library, minus an empty one. "
        f"CPU load (1-minute average) at start and end: {load_at_start:.1f} and {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} cores.",
        "",
        "| reader | random reads/s | / best | import, s |",
        "|---|---|---|---|",
        *(f"| {name} | {reads:,.0f} | {reads / best:.3f} | {seconds:.2f} |" for name, reads, seconds in rows),
        "",
        "The choice, `dataset=arrow`: the save_to_disk layout read with pyarrow alone. A read is a bisect and a",
        "slice of a memory-mapped file, so it costs microseconds next to an image decode (a 64x64 PNG: ~100 us),",
        "and pages are file-backed: a process's anonymous memory does not grow with the data. pyarrow is one",
        "dependency (`datasets` adds pandas, fsspec, huggingface-hub, ... and 1-2 s of import to every process),",
        "and the files stay `datasets`' own: `load_from_disk` reads ours, a user's `save_to_disk` output is",
        "valid input. wids reads tar shards about as fast as `datasets` reads Arrow, imports torch itself",
        "(its import time above is mostly torch's, which a run pays anyway), and by default copies even local",
        "shards into /tmp/_wids_cache (`localname` avoids it).",
    ]
    text = "\n".join(lines) + "\n"
    args.output.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
