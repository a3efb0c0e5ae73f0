"""Benchmark: how closely 1 process and 2 ranks agree, step by step, on the same run (same seed, same global batch).

    python benchmarks/rank_agreement.py                       # writes benchmarks/RANK_AGREEMENT.md
    python benchmarks/rank_agreement.py --steps 1 16 64 240 --configs default adam sgd

For each config and each of `--steps`, the real command line trains the digits recipe twice for that many optimizer
steps (`trainer.max_steps`: the schedule is the whole run's, so these are the first N steps of the default run),
`python train.py ...` and `torchrun --nproc_per_node=2 train.py ...`, global batch 64 in both (32 per rank), the same
seed. It reports the largest absolute difference between the two `checkpoints/last.pt` models, over the trained
parameters and over BatchNorm's running statistics (averaged, not trained), and their val metrics, evaluated by
one `python eval.py -m checkpoint=... split=val` in one process (evaluation is exact on any world size, so what
differs is training alone). The table is written with the date, the CPU model and the torch version.

The ranks compute in another order than one process (an all-reduce sums two halves of each gradient; sync-BN sums
two halves of each statistic), so step 1 agrees to float rounding; after that, each difference is fed back through
the next steps, and what it grows to depends on the optimizer. Not a test: `tests/integration/test_equivalence.py`
holds the guarantee (within 1e-5 after a short run); this measures how agreement evolves over a longer one.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
RUNNING_STATISTICS = ("running_mean", "running_var")  # BatchNorm's buffers: averaged, not trained

# name -> train.py overrides on top of the default digits run (small CNN without biases before BatchNorm, sync-BN,
# global batch 64, cosine schedule over 20 epochs of 22 steps).
CONFIGS = {
    "default": [],  # AdamW 3e-3
    "adam": ["optimizer=adam"],  # Adam 1e-3
    "sgd": ["optimizer=sgd"],  # SGD 0.1, Nesterov momentum
}


def train(launcher: list[str], overrides: list[str], steps: int, run_dir: Path) -> Path:
    """Train `steps` optimizer steps (`trainer.max_steps`: the schedule is the whole run's, so this is the first
    `steps` steps of it) and return the checkpoint holding the weights after them."""
    checked([*launcher, str(REPO / "train.py"), *overrides, f"trainer.max_steps={steps}", "trainer.test=false",
             "trainer.progress=false", f"hydra.run.dir={run_dir}"])
    return run_dir / "checkpoints" / "last.pt"


def checked(command: list[str]) -> None:
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"failed ({result.returncode}): {' '.join(command)}\n{result.stderr[-3000:]}")


def model_weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["models"]["model"]


def largest_difference(one: dict[str, torch.Tensor], two: dict[str, torch.Tensor],
                       statistics: bool) -> tuple[float, str]:
    """The largest |one - two| over the trained parameters (statistics=False) or over BatchNorm's running statistics
    (statistics=True), and the tensor's name."""
    differences = {name: (one[name] - two[name]).abs().max().item() for name in one
                   if one[name].is_floating_point() and name.endswith(RUNNING_STATISTICS) == statistics}
    name = max(differences, key=differences.get)
    return differences[name], name


def val_metrics(checkpoints: list[Path], workdir: Path) -> dict[Path, dict[str, float]]:
    """Each checkpoint's val metrics, by one `python eval.py -m checkpoint=A,B,... split=val` (one process, a job
    per checkpoint)."""
    sweep = workdir / "eval"
    checked([sys.executable, str(REPO / "eval.py"), "-m", f"checkpoint={','.join(map(str, checkpoints))}",
             "split=val", f"hydra.sweep.dir={sweep}"])
    results = [json.loads(path.read_text()) for path in sweep.glob("*/metrics.json")]
    return {Path(result["checkpoint"]): result for result in results}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def table_rows(configs: list[str], steps: list[int], workdir: Path) -> list[str]:
    checkpoints = {(config, step, world): train([sys.executable] if world == 1 else TORCHRUN, CONFIGS[config], step,
                                                workdir / f"{config}-{step}-{world}")
                   for config in configs for step in steps for world in (1, 2)}
    val = val_metrics(list(checkpoints.values()), workdir)
    rows = []
    for config in configs:
        for step in steps:
            one, two = (checkpoints[config, step, world] for world in (1, 2))
            weights, statistics = model_weights(one), model_weights(two)
            parameters, where = largest_difference(weights, statistics, statistics=False)
            running, _ = largest_difference(weights, statistics, statistics=True)
            rows.append(f"| {config} | {' '.join(CONFIGS[config]) or '(none: AdamW)'} | {step} | {parameters:.1e} | "
                        f"`{where}` | {running:.1e} | {val[one]['val/acc']:.4f} / {val[two]['val/acc']:.4f} | "
                        f"{abs(val[one]['val/acc'] - val[two]['val/acc']):.4f} | "
                        f"{abs(val[one]['val/loss'] - val[two]['val/loss']):.1e} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 16, 64, 240])
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "RANK_AGREEMENT.md")
    args = parser.parse_args()
    steps = sorted(set(args.steps))
    with tempfile.TemporaryDirectory() as folder:
        rows = table_rows(args.configs, steps, Path(folder))
    command = (f"python benchmarks/rank_agreement.py --steps {' '.join(map(str, steps))} "
               f"--configs {' '.join(args.configs)}")
    report = (f"# 1 process against 2 ranks: weights and val metrics, step by step\n\n"
              f"`{command}`: the digits recipe (global batch 64; 22 optimizer steps an epoch), trained by "
              f"`python train.py` and by `torchrun --nproc_per_node=2 train.py` with the same seed; the val split "
              f"(180 samples) evaluated by `eval.py` in one process.\n\n"
              f"Measured {date.today().isoformat()} on {cpu_model()} ({torch.get_num_threads()} torch threads), "
              f"torch {torch.__version__}, Python {platform.python_version()}, CPU, gloo.\n\n"
              f"| config | overrides | optimizer steps | max abs difference of the parameters | in "
              f"| max abs difference of BatchNorm's running statistics | val acc, 1 process / 2 ranks "
              f"| val acc difference | val loss difference |\n|---|---|---|---|---|---|---|---|---|\n"
              + "\n".join(rows) + "\n")
    args.output.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
