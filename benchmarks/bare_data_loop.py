"""The baseline for data read from files: a plain DataLoader loop, as a researcher would write it, over the same
files with the same decode and transforms as the template's `dataset=image_folder` / `dataset=arrow` runs.

    python benchmarks/bare_data_loop.py --format image_folder --root IMAGES --num-workers 2 --epochs 2
    python benchmarks/bare_data_loop.py --format arrow --root CONVERTED --num-workers 0 --epochs 2

Same model class (SimpleCNN), optimizer settings (conf/optimizer/sgd.yaml), batch and transforms; no seeding per
sample, no validation, no checkpoints. Prints one JSON line: samples_per_s (training only) and first_step_at.
"""

import argparse
import json
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
    first_step_at, train_seconds, samples = None, 0.0, 0
    for _ in range(args.epochs):
        started = time.perf_counter()
        for images, labels in loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            samples += len(labels)
            if first_step_at is None:
                first_step_at = time.time()
        train_seconds += time.perf_counter() - started
    print(json.dumps({"samples_per_s": samples / train_seconds, "first_step_at": first_step_at, "loss": loss.item()}))


if __name__ == "__main__":
    main()
