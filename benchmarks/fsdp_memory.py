"""Benchmark: per-rank memory of dist=ddp against dist=fsdp on a model large enough to measure.

    python benchmarks/fsdp_memory.py                 # W = 1 (baseline), 2, 3; writes benchmarks/FSDP_MEMORY.md
    python benchmarks/fsdp_memory.py --layers 2      # a smaller model (quick check)

A wide MLP (src/components/models.py: 4096 inputs, 6 hidden layers of 4096, 10 outputs: 100.7M parameters)
trains 3 AdamW steps on synthetic data, wrapped by the template's own `prepare_model` (DDP, or FSDP2 with
the default `dist.fsdp` settings), under torchrun on the CPU (gloo). After the last backward each rank counts
the bytes of the tensors it holds itself (a DTensor's local shard, not its global size): parameters,
gradients and optimizer state (AdamW: exp_avg, exp_avg_sq), and reads its peak resident set size
(getrusage), also less the RSS it had before building the model (torch and the process group: ~0.7 GiB).
DDP holds all of them on every rank (and its gradient buckets, another copy of the gradients); FSDP 1/W of
each, plus what it gathers for one unit at a time. `fsdp` builds the model as train.py does by default: on the
meta device, sharded, then only this rank's shards allocated and initialised (src/loop/initial_weights.py);
`fsdp-whole` builds it whole on every rank before sharding (trainer.init_weights=constructor, the path of a
model that cannot be built on meta, and of every model before), so its peak RSS includes one full copy of the
parameters at start-up. Not a test: RSS
depends on the allocator and the machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CASES = [("ddp", 1), ("ddp", 2), ("fsdp-whole", 2), ("fsdp", 2), ("ddp", 3), ("fsdp-whole", 3), ("fsdp", 3)]
MIB = 2**20


def local_bytes(tensor) -> int:  # noqa: ANN001 - a Tensor or DTensor
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def worker(strategy: str, width: int, layers: int, out: Path) -> None:
    """One rank: build, wrap, train 3 steps, count, write rank<R>.json."""
    import torch

    from src.components.models import MLP
    from src.config.schema import FsdpConfig
    from src.loop import initial_weights
    from src.parallel import distributed

    with distributed.process_group("cpu", "gloo", 600.0) as runtime:
        start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # torch imported, no model yet
        named = strategy == "fsdp"  # trainer.init_weights: by_name (dist=fsdp's default), else constructor
        torch.manual_seed(0)
        model = initial_weights.build(lambda: MLP(in_features=width, num_outputs=10, hidden_sizes=(width,) * layers),
                                      0, named, sharded=strategy.startswith("fsdp"))
        sharding = FsdpConfig() if strategy.startswith("fsdp") else None
        module, train_model = distributed.prepare_model(model, runtime, False, False, sharding)
        if named:
            initial_weights.initialise(module, 0)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, foreach=False)
        for step in range(3):
            if step:
                optimizer.zero_grad(set_to_none=True)
            inputs, target = torch.randn(8, width), torch.randint(0, 10, (8,))
            torch.nn.functional.cross_entropy(train_model(inputs), target).backward()
            optimizer.step()
        counts = {
            "parameters": sum(p.numel() for p in module.parameters()),
            "param_bytes": sum(local_bytes(p) for p in module.parameters()),
            "grad_bytes": sum(local_bytes(p.grad) for p in module.parameters() if p.grad is not None),
            "optimizer_bytes": sum(local_bytes(value) for state in optimizer.state.values()
                                   for value in state.values() if isinstance(value, torch.Tensor)),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "start_rss_bytes": start_rss,
        }
        (out / f"rank{runtime.env.rank}.json").write_text(json.dumps(counts))


def measure(strategy: str, world_size: int, width: int, layers: int) -> dict[str, float]:
    """One case under torchrun; the largest value over its ranks of each count."""
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
                   __file__, "--worker", strategy, "--out", folder, "--width", str(width), "--layers", str(layers)]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"{strategy} x{world_size} failed:\n{result.stderr[-3000:]}")
        ranks = [json.loads(path.read_text()) for path in sorted(Path(folder).glob("rank*.json"))]
    return {key: max(rank[key] for rank in ranks) for key in ranks[0]}


def table(results: list[tuple[str, int, dict[str, float]]]) -> str:
    baseline = results[0][2]
    base_state = baseline["param_bytes"] + baseline["grad_bytes"] + baseline["optimizer_bytes"]
    lines = ["| dist | W | parameters (MiB) | gradients (MiB) | optimizer state (MiB) | sum (MiB) | sum / 1-rank sum "
             "| peak RSS per rank (MiB) | peak RSS minus RSS before the model (MiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for strategy, world_size, counts in results:
        state = counts["param_bytes"] + counts["grad_bytes"] + counts["optimizer_bytes"]
        mib = {key: f"{value / MIB:,.0f}" for key, value in counts.items() if key.endswith("bytes")}
        lines.append(f"| {strategy} | {world_size} | {mib['param_bytes']} | {mib['grad_bytes']} | "
                     f"{mib['optimizer_bytes']} | {state / MIB:,.0f} | {state / base_state:.3f} | "
                     f"{mib['peak_rss_bytes']} | {(counts['peak_rss_bytes'] - counts['start_rss_bytes']) / MIB:,.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "FSDP_MEMORY.md")
    parser.add_argument("--without-whole", action="store_true", help="leave out the fsdp-whole rows (a quick run)")
    parser.add_argument("--worker", choices=("ddp", "fsdp", "fsdp-whole"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.width, args.layers, args.out)
        from src.parallel.distributed import exit_after_a_group

        exit_after_a_group()  # the gloo group's threads could abort the interpreter's teardown (its docstring)
        return
    results = [(strategy, world_size, measure(strategy, world_size, args.width, args.layers))
               for strategy, world_size in CASES if not (args.without_whole and strategy == "fsdp-whole")]
    report = (f"# dist=ddp vs dist=fsdp: per-rank memory\n\n`python benchmarks/fsdp_memory.py --width {args.width} "
              f"--layers {args.layers}`: an MLP of {results[0][2]['parameters']:,} parameters (fp32), AdamW, 3 steps "
              f"of 8 samples per rank, CPU/gloo. Largest value over the ranks.\n\n{table(results)}\n")
    args.output.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
