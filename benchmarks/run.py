"""Benchmark: the template's training loop against a plain hand-written loop, in one run.

    python benchmarks/run.py                 # 3 repeats, writes benchmarks/RESULTS.md
    python benchmarks/run.py --repeats 5 --epochs 20

Each case runs the template (`train.py`) and the bare loop (`benchmarks/bare_loop.py`) as
separate processes, interleaved (ours, bare, ours, bare, ...) so that a busy machine slows
both alike, and reports the median of the repeats and the ratio ours / bare:
- digits + cnn, one process: training throughput (samples/s), whole-process wall time, and
  the time from command start to the first training step;
- synthetic 28x28 + cnn, 2 ranks under torchrun, with and without sync-BN.
Not a test: numbers on a shared machine are noisy; only the ratios within one run mean much.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
START_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[INFO\] run dir .* \| world size", re.M)


def run_checked(command: list[str]) -> str:
    """Run `command` from the repo root and return its stdout; on failure, exit showing its stderr."""
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"benchmark command failed ({result.returncode}): {' '.join(command)}\n{result.stderr[-3000:]}")
    return result.stdout


def run_template(launcher: list[str], args: list[str], workdir: Path) -> dict[str, float]:
    run_dir = workdir / f"run-{time.time_ns()}"
    started = time.time()
    run_checked([*launcher, str(REPO / "train.py"), *args, f"hydra.run.dir={run_dir}"])
    wall = time.time() - started
    metrics = json.loads((run_dir / "metrics.json").read_text())
    # The start-of-run line is logged right before the first step.
    first_step = datetime.strptime(START_LINE.search((run_dir / "train.log").read_text()).group(1),
                                   "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return {"samples_per_s": metrics["samples_per_s"], "wall_s": wall, "first_step_s": first_step - started}


def run_bare(launcher: list[str], args: list[str]) -> dict[str, float]:
    started = time.time()
    stdout = run_checked([*launcher, str(REPO / "benchmarks" / "bare_loop.py"), *args])
    wall = time.time() - started
    report = json.loads(stdout.strip().splitlines()[-1])
    return {"samples_per_s": report["samples_per_s"], "wall_s": wall, "first_step_s": report["first_step_at"] - started}


def interleaved(repeats: int, ours, bare) -> tuple[dict[str, float], dict[str, float]]:
    runs_ours, runs_bare = [], []
    for _ in range(repeats):
        runs_ours.append(ours())
        runs_bare.append(bare())
    median = lambda runs: {k: statistics.median(r[k] for r in runs) for k in runs[0]}  # noqa: E731
    return median(runs_ours), median(runs_bare)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=20, help="digits epochs (synthetic runs a quarter)")
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "RESULTS.md")
    parser.add_argument("--cases", nargs="+", choices=["digits", "ddp"], default=["digits", "ddp"],
                        help="which cases to run (default: all)")
    args = parser.parse_args()
    python = [sys.executable]
    rows = []
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if "digits" in args.cases:
            ours, bare = interleaved(
                args.repeats,
                lambda: run_template(python, [f"trainer.epochs={args.epochs}"], workdir),
                lambda: run_bare(python, ["--dataset", "digits", "--epochs", str(args.epochs), "--batch-size", "64"]),
            )
            rows.append(("digits + cnn, 1 process: training samples/s", ours["samples_per_s"], bare["samples_per_s"]))
            rows.append(("digits + cnn, 1 process: whole process, s", ours["wall_s"], bare["wall_s"]))
            rows.append(("digits + cnn, 1 process: start to first step, s", ours["first_step_s"],
                         bare["first_step_s"]))
        epochs = max(1, args.epochs // 4)
        synthetic = ["dataset=synthetic", f"trainer.epochs={epochs}"]
        bare_synthetic = ["--dataset", "synthetic", "--epochs", str(epochs), "--batch-size", "128"]
        for sync_bn in ("true", "false") if "ddp" in args.cases else ():
            ours, bare = interleaved(
                args.repeats,
                lambda: run_template(TORCHRUN, [*synthetic, f"dist.sync_bn={sync_bn}"], workdir),
                lambda: run_bare(TORCHRUN, bare_synthetic),
            )
            rows.append((f"synthetic 28x28 + cnn, 2 ranks (sync_bn={sync_bn}): samples/s",
                         ours["samples_per_s"], bare["samples_per_s"]))
    lines = [
        f"# Benchmark results ({datetime.now():%Y-%m-%d}, `python benchmarks/run.py --repeats {args.repeats} "
        f"--epochs {args.epochs}`)",
        "",
        "Median of the repeats, template and bare loop interleaved in one run. The bare 2-rank loop uses plain",
        "BatchNorm; with sync_bn=true the template also all-reduces BN statistics, which the bare loop does not do.",
        "",
        f"CPU load (1-minute average) at start and end: {load_at_start:.1f} and {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores; above about 1, other work shared the CPU and the numbers are noisier.",
        "",
        "| case | template | bare loop | template / bare |",
        "|---|---|---|---|",
    ]
    lines += [f"| {name} | {ours:.2f} | {bare:.2f} | {ours / bare:.3f} |" for name, ours, bare in rows]
    text = "\n".join(lines) + "\n"
    args.output.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
