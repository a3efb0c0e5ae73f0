"""Benchmark: how long a checkpoint stops the training thread, trainer.async_checkpoint=true against false.

    python benchmarks/checkpoint_stall.py                  # dist=fsdp and dist=ddp, W=2; writes CHECKPOINT_STALL.md
    python benchmarks/checkpoint_stall.py --layers 2       # a smaller model (quick check)

The 100.7M-parameter MLP of benchmarks/fsdp_memory.py (AdamW: a checkpoint holds the parameters and two
moments, 1.2 GB) trains under torchrun on the CPU (gloo), wrapped by the template's `prepare_model`, and saves
through the template's own store (src/checkpoint/) every `--steps` steps: sharded directories under dist=fsdp,
one .pt under dist=ddp. The stall is the time `store.save` takes on the training thread: the whole write when
synchronous; with async_checkpoint, the copy of the state to host memory (plus any wait for the previous
write still in flight). Sync and async runs alternate (`--repeats` pairs); each run's first save is left out
(first-touch page faults); the table gives the median stall over the rest, the largest over the ranks.
The writer thread shares the CPU with training, so the steps between saves are timed too.
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
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def worker(strategy: str, background: bool, width: int, layers: int, saves: int, steps: int, out: Path) -> None:
    """One rank: train, save every `steps` steps through the run's store, time each save; write rank<R>.json."""
    import torch

    from src import checkpoint
    from src.components.models import MLP
    from src.config.schema import FsdpConfig
    from src.parallel import distributed

    timeout_s = 600.0
    with distributed.process_group("cpu", "gloo", timeout_s) as runtime:
        torch.manual_seed(0)
        model = MLP(in_features=width, num_outputs=10, hidden_sizes=(width,) * layers)
        sharding = FsdpConfig() if strategy == "fsdp" else None
        module, train_model = distributed.prepare_model(model, runtime, False, False, sharding)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, foreach=False)
        store = checkpoint.open_store(SimpleNamespace(strategy=strategy, timeout_s=timeout_s, step_timeout_s=None),
                                      SimpleNamespace(keep_last=1, async_checkpoint=background),
                                      out / "checkpoints", runtime.is_main_process)
        stalls, step_seconds = [], []
        for save in range(saves):
            started = time.perf_counter()
            for _ in range(steps):
                inputs, target = torch.randn(8, width), torch.randint(0, 10, (8,))
                torch.nn.functional.cross_entropy(train_model(inputs), target).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            step_seconds.append((time.perf_counter() - started) / steps)
            started = time.perf_counter()
            store.save({"model": module, "optimizer": optimizer, "loop": {"step": save}}, save + 1, False, True)
            stalls.append(time.perf_counter() - started)
        started = time.perf_counter()
        store.wait()
        final_wait = time.perf_counter() - started
        (out / f"rank{runtime.env.rank}.json").write_text(
            json.dumps({"stalls": stalls, "step_seconds": step_seconds, "final_wait": final_wait}))


def measure(strategy: str, background: bool, args: argparse.Namespace) -> dict[str, float]:
    """One run under torchrun: median stall (first save left out) and median step time, largest over ranks."""
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
                   "--worker", strategy, "--out", folder, "--width", str(args.width), "--layers", str(args.layers),
                   "--saves", str(args.saves), "--steps", str(args.steps), *(["--background"] if background else [])]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"{strategy} background={background} failed:\n{result.stderr[-3000:]}")
        ranks = [json.loads(path.read_text()) for path in sorted(Path(folder).glob("rank*.json"))]
    return {"stall": max(statistics.median(rank["stalls"][1:]) for rank in ranks),
            "step": max(statistics.median(rank["step_seconds"][1:]) for rank in ranks),
            "final_wait": max(rank["final_wait"] for rank in ranks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="training steps between saves")
    parser.add_argument("--repeats", type=int, default=2, help="sync/async pairs per strategy")
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints are written (default: a temp dir)")
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "CHECKPOINT_STALL.md")
    parser.add_argument("--strategies", default="fsdp,ddp", help="the dist.strategy rows, comma-separated")
    parser.add_argument("--worker", choices=("ddp", "fsdp"), help=argparse.SUPPRESS)
    parser.add_argument("--background", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.background, args.width, args.layers, args.saves, args.steps, args.out)
        from src.parallel.distributed import exit_after_a_group

        exit_after_a_group()
        return
    lines = ["| dist | W | stall per save, sync (s) | stall per save, async (s) | async / sync "
             "| step time, sync (s) | step time, async (s) |", "|---|---|---|---|---|---|---|"]
    for strategy in args.strategies.split(","):
        runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for _ in range(args.repeats):
            for background in (False, True):  # interleaved
                runs[background].append(measure(strategy, background, args))
        sync, asynchronous = ({key: statistics.median(run[key] for run in runs[mode]) for key in runs[mode][0]}
                              for mode in (False, True))
        lines.append(f"| {strategy} | 2 | {sync['stall']:.3f} | {asynchronous['stall']:.3f} | "
                     f"{asynchronous['stall'] / sync['stall']:.3f} | {sync['step']:.3f} | {asynchronous['step']:.3f} |")
        print(lines[-1], flush=True)
    report = (f"# Checkpoint stall on the training thread: trainer.async_checkpoint\n\n`python "
              f"benchmarks/checkpoint_stall.py --width {args.width} --layers {args.layers} --saves {args.saves} "
              f"--steps {args.steps} --repeats {args.repeats}`: medians over saves 2..{args.saves} of each run and "
              f"over {args.repeats} interleaved runs per mode, CPU/gloo.\n\n" + "\n".join(lines) + "\n")
    args.output.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
