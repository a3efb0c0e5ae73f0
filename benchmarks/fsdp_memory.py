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
`fsdp-whole` builds it whole on every rank before sharding (the same MLP without its `init_module`: the path of
a model that declares no initialisation hook), so its peak RSS includes one full copy of the parameters at
start-up. Not a test: RSS
depends on the allocator and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from datetime import datetime
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

    class WholeMLP(MLP):
        init_module = None  # no initialisation hook: built by its constructor, whole on every rank

    with distributed.process_group("cpu", "gloo", 600.0) as runtime:
        start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # torch imported, no model yet
        torch.manual_seed(0)
        model_class = WholeMLP if strategy == "fsdp-whole" else MLP
        initial = initial_weights.build(lambda: model_class(in_features=width, num_outputs=10,
                                                            hidden_sizes=(width,) * layers),
                                        "model", 0, sharded=strategy.startswith("fsdp"))
        sharding = FsdpConfig() if strategy.startswith("fsdp") else None
        module, train_model = distributed.prepare_model(
            initial.model, runtime, False, False, sharding,
            initialise=lambda prepared: initial_weights.initialise(initial, prepared, 0))
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


# -- host memory by layer shape: a frozen backbone built on the meta device, through train.py -------------------

FROZEN_SHAPES = ["30x3072", "34x2880", "60x2048", "1x16384"]  # the research issue's three, and one very wide layer
TUNABLE = {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4194304"}  # 4 MiB: below every gathered unit


def hidden_sizes(shape: str) -> list[int]:
    layers, width = map(int, shape.split("x"))
    return [width] * layers if layers > 1 else [width, width]  # one width x width layer: between two of that width


def frozen_bytes(sizes: list[int], world_size: int, min_unit_params: int = 1_000_000) -> tuple[int, int, int]:
    """(parameters, a rank's shards in bytes: its share of the fp32 parameters and of the trainable head's AdamW
    state, the two largest units gathered in bytes) of the digits MLP with every hidden layer frozen."""
    widths = [64, *sizes]
    layers = [(a, b) for a, b in zip(widths, widths[1:])] + [(widths[-1], 10)]
    params = [a * b + b for a, b in layers]
    head = params[-1]
    units = sorted((p for p in params if p >= min_unit_params), reverse=True) or [sum(params)]
    return sum(params), (sum(params) * 4 + head * 8) // world_size, sum(units[:2]) * 4


def peak_vm_data(args: list[str], env: dict[str, str], world_size: int = 2) -> list[int]:
    """Each worker's peak VmData (bytes) over a torchrun of train.py `args`, sampled every 0.1 s."""
    import time

    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
                   str(REPO / "train.py"), *args, f"hydra.run.dir={folder}/run"]
        process = subprocess.Popen(command, cwd=folder, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        peaks: dict[int, int] = {}
        while process.poll() is None:
            for pid, data in workers_vm_data(process.pid).items():
                peaks[pid] = max(peaks.get(pid, 0), data)
            time.sleep(0.1)
        if process.returncode != 0:
            sys.exit(f"train.py {' '.join(args)} failed:\n{process.stderr.read()[-3000:]}")
    return sorted(peaks.values())


def workers_vm_data(launcher: int) -> dict[int, int]:
    """VmData (bytes) of the launcher's workers (its children with a RANK), by pid."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            fields = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines() if ":" in line)
            is_worker = b"\0RANK=" in b"\0" + (entry / "environ").read_bytes()
        except OSError:
            continue
        if int(fields.get("PPid", "0")) == launcher and "VmData" in fields and is_worker:
            found[int(entry.name)] = int(fields["VmData"].split()[0]) * 1024
    return found


def frozen_run(sizes: list[int]) -> list[str]:
    freeze = ",".join(f"net.{3 * layer + 1}." for layer in range(len(sizes)))
    return ["model=mlp", f"model.hidden_sizes=[{','.join(map(str, sizes))}]", "dist=fsdp", "optimizer.fused=null",
            f"trainer.freeze=[{freeze}]", "dataset.batch_size=48", "trainer.max_steps=1", "trainer.progress=false",
            "trainer.save_checkpoints=false"]


def shapes_report(shapes: list[str]) -> str:
    """Peak VmData per rank of each shape, with glibc's allocator as it comes and with TUNABLE, against the bound
    start-up + 1.25 x (shards + two gathered units); start-up: the same run's peak with a 64-wide model."""
    startup = max(peak_vm_data(frozen_run([64]), {}))
    lines = [f"Start-up (the same command with `model.hidden_sizes=[64]`): {startup / MIB:,.0f} MiB per rank.", "",
             "| shape | parameters | shards + 2 units (MiB) | bound (MiB) | peak VmData per rank, glibc as it comes "
             f"(MiB) | peak with `GLIBC_TUNABLES={TUNABLE['GLIBC_TUNABLES']}` (MiB) |", "|---|---|---|---|---|---|"]
    for shape in shapes:
        sizes = hidden_sizes(shape)
        count, shards, units = frozen_bytes(sizes, 2)
        bound = startup + 1.25 * (shards + units)
        peaks = [peak_vm_data(frozen_run(sizes), env) for env in ({}, TUNABLE)]
        cells = [" / ".join(f"{peak / MIB:,.0f}{'' if peak <= bound else ' (over)'}" for peak in ranks)
                 for ranks in peaks]
        lines.append(f"| {shape} | {count / 1e6:.1f}M | {(shards + units) / MIB:,.0f} | {bound / MIB:,.0f} | "
                     f"{cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "FSDP_MEMORY.md")
    parser.add_argument("--without-whole", action="store_true", help="leave out the fsdp-whole rows (a quick run)")
    parser.add_argument("--shapes", nargs="*", metavar="LAYERSxWIDTH",
                        help=f"instead: host memory of a frozen MLP of each shape (default {' '.join(FROZEN_SHAPES)})")
    parser.add_argument("--worker", choices=("ddp", "fsdp", "fsdp-whole"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.width, args.layers, args.out)
        from src.parallel.distributed import exit_after_a_group

        exit_after_a_group()  # the gloo group's threads could abort the interpreter's teardown (its docstring)
        return
    if args.shapes is not None:
        report = (f"# dist=fsdp: host memory by layer shape ({datetime.now():%Y-%m-%d}, {os.cpu_count()} cores, "
                  f"CPU/gloo)\n\n`python benchmarks/fsdp_memory.py --shapes {' '.join(args.shapes or FROZEN_SHAPES)}`"
                  ": the digits MLP with every hidden layer frozen, built on the meta device, 2 ranks, batch 48, one "
                  "step (the research issue's command).\n\n" + shapes_report(args.shapes or FROZEN_SHAPES) + "\n")
        output = args.output.with_name("FSDP_HOST_MEMORY.md") if args.output.name == "FSDP_MEMORY.md" else args.output
        output.write_text(report)
        print(report)
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
