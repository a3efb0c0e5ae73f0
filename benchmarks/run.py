"""Benchmark: the template's training loop against a plain hand-written loop and a Lightning Trainer, in one run.

    python benchmarks/run.py                 # 3 repeats, writes benchmarks/RESULTS.md
    python benchmarks/run.py --repeats 5 --epochs 20
    python benchmarks/run.py --cases lightning --repeats 3 --epochs 10
    python benchmarks/run.py --cases digits --template-args callbacks.ema.decay=0.999   # the cost of a feature

Each case runs the template (`train.py`) and the bare loop (`benchmarks/bare_loop.py`) as
separate processes, interleaved (ours, bare, ours, bare, ...) so that a busy machine slows
both alike, and reports the median of the repeats and the ratio ours / bare:
- digits: digits + cnn, one process: training throughput (samples/s), whole-process wall time,
  and the time from command start to the first training step;
- ddp: synthetic 28x28 + cnn, 2 ranks under torchrun, with and without sync-BN;
- lightning: the digits case with a third process interleaved (ours, bare, Lightning, ...):
  `benchmarks/lightning_loop.py`, the same job run by a Lightning Trainer, and the ratios
  ours / Lightning. Lightning is not a dependency of the template; the case needs
  `pip install -r benchmarks/requirements-lightning.txt`, and the default runs it only when
  Lightning is importable.
Not a test: numbers on a shared machine are noisy; only the ratios within one run mean much.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
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
LIGHTNING_INSTALL = f"{sys.executable} -m pip install -r {REPO / 'benchmarks' / 'requirements-lightning.txt'}"
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


def run_script(script: str, launcher: list[str], args: list[str]) -> dict[str, float]:
    """Run a baseline script of benchmarks/ (bare_loop.py, lightning_loop.py): its last stdout line is a JSON report."""
    started = time.time()
    stdout = run_checked([*launcher, str(REPO / "benchmarks" / script), *args])
    wall = time.time() - started
    report = json.loads(stdout.strip().splitlines()[-1])
    return {"samples_per_s": report["samples_per_s"], "wall_s": wall, "first_step_s": report["first_step_at"] - started}


def interleaved(repeats: int, *programs) -> list[dict[str, float]]:
    """Run each program once per repeat, in turn (a, b, c, a, b, c, ...); the median of each one's results."""
    runs = [[] for _ in programs]
    for _ in range(repeats):
        for results, program in zip(runs, programs):
            results.append(program())
    return [{key: statistics.median(run[key] for run in results) for key in results[0]} for results in runs]


def table(columns: tuple[str, str], rows: list[tuple[str, float, float]]) -> list[str]:
    """A Markdown table: case | template | `columns[0]` | template / `columns[1]`."""
    lines = [f"| case | template | {columns[0]} | template / {columns[1]} |", "|---|---|---|---|"]
    return lines + [f"| {name} | {ours:.2f} | {other:.2f} | {ours / other:.3f} |" for name, ours, other in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=20, help="digits epochs (synthetic runs a quarter)")
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "RESULTS.md")
    parser.add_argument("--cases", nargs="+", choices=["digits", "ddp", "lightning"],
                        help="which cases to run (default: all; lightning only if it is installed)")
    parser.add_argument("--template-args", nargs="*", default=[], metavar="KEY=VALUE",
                        help="overrides added to every template run, e.g. callbacks.ema.decay=0.999")
    args = parser.parse_args()
    has_lightning = importlib.util.find_spec("lightning") is not None
    if args.cases is None:
        args.cases = ["digits", "ddp", "lightning"] if has_lightning else ["digits", "ddp"]
        if not has_lightning:
            print(f"Lightning is not installed, so the comparison with it is skipped; to add it: {LIGHTNING_INSTALL}")
    elif "lightning" in args.cases and not has_lightning:
        sys.exit(f"the lightning case needs Lightning, which is not a dependency of the template: {LIGHTNING_INSTALL}")
    python = [sys.executable]
    rows, lightning_rows = [], []
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if "digits" in args.cases or "lightning" in args.cases:
            job = ["--epochs", str(args.epochs), "--batch-size", "64"]
            programs = [
                lambda: run_template(python, [f"trainer.epochs={args.epochs}", *args.template_args], workdir),
                lambda: run_script("bare_loop.py", python, ["--dataset", "digits", *job]),
            ]
            if "lightning" in args.cases:
                programs.append(lambda: run_script("lightning_loop.py", python, job))
            ours, bare, *lightning = interleaved(args.repeats, *programs)
            measures = [("training samples/s", "samples_per_s"), ("whole process, s", "wall_s"),
                        ("start to first step, s", "first_step_s")]
            rows += [(f"digits + cnn, 1 process: {name}", ours[key], bare[key]) for name, key in measures]
            if lightning:
                lightning_rows += [(f"digits + cnn, 1 process: {name} vs Lightning", ours[key], lightning[0][key])
                                   for name, key in measures]
        epochs = max(1, args.epochs // 4)
        synthetic = ["dataset=synthetic", f"trainer.epochs={epochs}"]
        bare_synthetic = ["--dataset", "synthetic", "--epochs", str(epochs), "--batch-size", "128"]
        for sync_bn in ("true", "false") if "ddp" in args.cases else ():
            ours, bare = interleaved(
                args.repeats,
                lambda: run_template(TORCHRUN, [*synthetic, f"dist.sync_bn={sync_bn}", *args.template_args], workdir),
                lambda: run_script("bare_loop.py", TORCHRUN, bare_synthetic),
            )
            rows.append((f"synthetic 28x28 + cnn, 2 ranks (sync_bn={sync_bn}): samples/s",
                         ours["samples_per_s"], bare["samples_per_s"]))
    lines = [
        f"# Benchmark results ({datetime.now():%Y-%m-%d}, `python benchmarks/run.py --repeats {args.repeats} "
        f"--epochs {args.epochs} --cases {' '.join(args.cases)}"
        f"{' --template-args ' + ' '.join(args.template_args) if args.template_args else ''}`)",
        "",
        "Median of the repeats, template and bare loop interleaved in one run. The bare 2-rank loop uses plain",
        "BatchNorm; with sync_bn=true the template also all-reduces BN statistics, which the bare loop does not do.",
        "",
        f"CPU load (1-minute average) at start and end: {load_at_start:.1f} and {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores; above about 1, other work shared the CPU and the numbers are noisier.",
        "",
        *table(("bare loop", "bare"), rows),
    ]
    if lightning_rows:
        lines += [
            "",
            f"Against Lightning {importlib.metadata.version('lightning')} (`benchmarks/lightning_loop.py`), run third",
            "in each round of the same run (ours, bare, Lightning, ...): the same job through a Lightning Trainer on",
            "CPU with one device and no logger, checkpoints, progress bar, model summary, sanity check or validation,",
            "fed by a DataLoader over the in-memory TensorDataset (num_workers=0). Lightning there only trains, while",
            "the template also validates every epoch and writes checkpoints, TensorBoard events and the confusion",
            "matrix: inside its whole-process time, outside its training samples/s. A samples/s ratio above 1 and a",
            "time ratio below 1 mean the template is faster.",
            "",
            *table(("Lightning", "Lightning"), lightning_rows),
        ]
    text = "\n".join(lines) + "\n"
    args.output.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
