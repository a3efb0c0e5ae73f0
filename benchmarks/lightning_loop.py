"""The same job as benchmarks/bare_loop.py (digits, one process) run by a Lightning Trainer,
set up as a user would for training speed: CPU, one device, no logger, checkpoints, progress
bar, model summary, sanity check or validation. Lightning is not a dependency of the template:

    pip install -r benchmarks/requirements-lightning.txt
    python benchmarks/lightning_loop.py --epochs 20 --batch-size 64

The data is fed the way Lightning users do: a DataLoader over the in-memory TensorDataset
(shuffled each epoch, the ragged tail dropped like the bare loop and the template do).
Prints one JSON line like bare_loop.py: samples_per_s (training epochs only, timed by a
Callback), first_step_at (wall clock after the first optimizer step) and the final train loss.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from src.components.datasets import digits  # noqa: E402  (the data, not the template's machinery)
from src.components.models import SimpleCNN  # noqa: E402


class Classifier(pl.LightningModule):
    """SimpleCNN trained with cross-entropy and AdamW, as in the bare loop."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self.model(images), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.05)


class EpochTimer(pl.Callback):
    """Wall time of the training epochs, the first step's time and the last loss."""

    def __init__(self):
        self.started = 0.0
        self.train_seconds = 0.0
        self.samples = 0
        self.first_step_at: float | None = None
        self.last_loss: torch.Tensor | None = None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: dict[str, torch.Tensor],
                           batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        if self.first_step_at is None:
            self.first_step_at = time.time()
        self.samples += len(batch[1])
        self.last_loss = outputs["loss"]

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.train_seconds += time.perf_counter() - self.started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    torch.manual_seed(0)
    splits = digits()
    model = Classifier(SimpleCNN(splits.info["in_channels"], splits.info["image_size"], splits.info["num_classes"]))
    loader = DataLoader(splits.train, batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=0,
                        generator=torch.Generator().manual_seed(0))
    timer = EpochTimer()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=args.epochs, callbacks=[timer],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(model, train_dataloaders=loader)
    print(json.dumps({
        "samples_per_s": timer.samples / timer.train_seconds,
        "first_step_at": timer.first_step_at,
        "loss": timer.last_loss.item(),
    }))


if __name__ == "__main__":
    main()
