"""The baseline for data read from files: a plain DataLoader loop, as a researcher would write it, over the same
files with the same decode and transforms as the template's `dataset=image_folder` / `dataset=arrow` runs.

    python benchmarks/bare_data_loop.py --format image_folder --root IMAGES --num-workers 2 --epochs 2
    python benchmarks/bare_data_loop.py --format arrow --root CONVERTED --num-workers 0 --epochs 2

Same model class (SimpleCNN), optimizer settings (conf/optimizer/sgd.yaml), learning-rate schedule (the template's
default, conf/scheduler/cosine.yaml: one epoch of linear warmup, then a half cosine to 0, stepped every step), batch
and transforms; no seeding per sample, no validation, no checkpoints. Prints one JSON line: samples_per_s (training
only), first_step_at and the last epoch's mean loss.

The schedule is part of "the same training": without its warmup, SGD at lr 0.1 diverges on this data within the first
epoch and leaves a network of dead ReLUs at chance loss, which is not the work the template's run does
(benchmarks/DATA_PIPELINE.md).
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from src.components.datasets import arrow, image_folder  # noqa: E402  (the data, not the template's machinery)
from src.components.models import SimpleCNN  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--format", choices=["image_folder", "arrow"], required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--crop-scale", type=float, nargs=2, default=(0.35, 1.0))
    args = parser.parse_args()

    torch.manual_seed(0)
    build = image_folder if args.format == "image_folder" else arrow
    splits = build(args.root, image_size=(args.image_size, args.image_size), crop_scale=args.crop_scale)
    loader = DataLoader(splits.train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        num_workers=args.num_workers, persistent_workers=args.num_workers > 0)
    model = SimpleCNN(splits.info["in_channels"], splits.info["image_size"], splits.info["num_classes"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4,
                                fused=True)
    warmup, total = len(loader), len(loader) * args.epochs

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    first_step_at, train_seconds, samples = None, 0.0, 0
    for _ in range(args.epochs):
        started, loss_sum = time.perf_counter(), torch.zeros(())
        for images, labels in loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_sum += loss.detach()
            samples += len(labels)
            if first_step_at is None:
                first_step_at = time.time()
        train_seconds += time.perf_counter() - started
    print(json.dumps({"samples_per_s": samples / train_seconds, "first_step_at": first_step_at,
                      "loss": loss_sum.item() / len(loader)}))


if __name__ == "__main__":
    main()
