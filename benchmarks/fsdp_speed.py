"""Benchmark: training throughput of dist=fsdp against dist=ddp, 2 ranks under torchrun, on the digits CNN.

    python benchmarks/fsdp_speed.py                  # 5 repeats of 5 epochs; writes benchmarks/FSDP_SPEED.md
    python benchmarks/fsdp_speed.py --repeats 3 --epochs 2

Each repeat runs `train.py` twice, interleaved (ddp, fsdp, ddp, fsdp, ...), so a busy machine slows both alike,
with the default recipe (small CNN, AdamW, global batch 64) and `samples_per_s` from metrics.json (training
steps only: evaluation and checkpoints are not timed). Reports the medians and fsdp / ddp. The digits CNN has
151k parameters: sharding it saves nothing worth having, and FSDP pays an all-gather per unit in the forward,
another in the backward and a reduce-scatter per unit instead of DDP's bucketed all-reduce. Both run AdamW's fused
kernel, which takes sharded parameters (src/loop/optim.py); the foreach case shows what that kernel saves. Not a
test: numbers on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


# name -> train.py overrides: DDP; FSDP as configured by default (the CNN's children hold fewer than
# dist.fsdp.min_unit_params parameters, so the whole model is one unit, which stays gathered from the forward
# to the backward: one all-gather and one reduce-scatter per step); FSDP with each child a unit of its own; the
# default FSDP with AdamW's foreach kernels instead of its fused one (what sharded parameters ran before).
CASES = {
    "ddp": ["dist=ddp"],
    "fsdp (default: one unit)": ["dist=fsdp"],
    "fsdp, a unit per child": ["dist=fsdp", "dist.fsdp.min_unit_params=0"],
    "fsdp, AdamW's foreach kernels": ["dist=fsdp", "optimizer.fused=null", "+optimizer.foreach=true"],
}


def throughput(case: str, epochs: int, workdir: Path) -> float:
    run_dir = workdir / f"run-{time.time_ns()}"
    command = [*TORCHRUN, str(REPO / "train.py"), *CASES[case], f"trainer.epochs={epochs}",
               "trainer.progress=false", f"hydra.run.dir={run_dir}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{case} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads((run_dir / "metrics.json").read_text())["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "FSDP_SPEED.md")
    args = parser.parse_args()
    samples: dict[str, list[float]] = {case: [] for case in CASES}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.repeats):
            for case in CASES:
                samples[case].append(throughput(case, args.epochs, Path(folder)))
    medians = {case: statistics.median(values) for case, values in samples.items()}
    rows = "".join(f"| {case} | `{' '.join(CASES[case])}` | {median:.0f} | {median / medians['ddp']:.2f} |\n"
                   for case, median in medians.items())
    runs = "; ".join(f"{case}: {', '.join(f'{value:.0f}' for value in values)}" for case, values in samples.items())
    report = (f"# dist=fsdp vs dist=ddp: throughput, digits CNN, 2 ranks (CPU, gloo)\n\n"
              f"`python benchmarks/fsdp_speed.py --repeats {args.repeats} --epochs {args.epochs}`, interleaved.\n\n"
              f"| case | overrides | samples/s (median) | / ddp |\n|---|---|---|---|\n{rows}\n"
              f"Every repeat (samples/s): {runs}\n")
    args.output.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
