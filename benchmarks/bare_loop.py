"""The baseline: a plain hand-written PyTorch training loop, as a researcher would write it
without any template. Same model class, data, batch size and step count as train.py.

    python benchmarks/bare_loop.py --dataset digits --epochs 20 --batch-size 64
    torchrun --nproc_per_node=2 benchmarks/bare_loop.py --dataset synthetic --epochs 3 --batch-size 128

Prints one JSON line: samples_per_s (training only, all ranks), seconds_to_first_step
(from interpreter start) and the final train loss.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from src.components.datasets import digits, synthetic  # noqa: E402  (the data, not the template's machinery)
from src.components.models import SimpleCNN  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", choices=["digits", "synthetic"], default="digits")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    args = parser.parse_args()

    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    if world_size > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    splits = digits() if args.dataset == "digits" else synthetic()
    images, labels = splits.train.tensors
    model = SimpleCNN(splits.info["in_channels"], splits.info["image_size"], splits.info["num_classes"])
    if world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    per_rank = args.batch_size // world_size
    steps = len(images) // args.batch_size

    first_step_at = None
    train_seconds = 0.0
    for epoch in range(args.epochs):
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(epoch))
        started = time.perf_counter()
        for step in range(steps):
            index = order[step * args.batch_size + rank * per_rank:][:per_rank]
            loss = F.cross_entropy(model(images[index]), labels[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if first_step_at is None:
                first_step_at = time.time()
        train_seconds += time.perf_counter() - started
    if rank == 0:
        print(json.dumps({
            "samples_per_s": args.epochs * steps * args.batch_size / train_seconds,
            "first_step_at": first_step_at,
            "loss": loss.item(),
        }))
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
