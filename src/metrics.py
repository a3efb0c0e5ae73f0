"""Classification metrics that are exact under DDP.

Each rank accumulates sums on its device (summed loss, correct predictions) and a
sample count, with no host sync per step. `compute()` all-reduces the three totals in
one collective, so the result is the sample-weighted mean over every rank's samples:
not a mean of per-rank means, not rank 0's value. Given the number of classes, it also
counts a confusion matrix, all-reduced in that same collective.
"""

from __future__ import annotations

from typing import Any

import torch

from src.distributed import all_reduce_sum


class ClassificationMetrics:
    """Running loss and accuracy over the samples seen since the last `reset()`; with
    `num_classes`, also the confusion matrix (rows: true class, columns: predicted)."""

    def __init__(self, device: torch.device, num_classes: int | None = None) -> None:
        # float64 keeps sums of thousands of per-sample losses exact enough to compare
        # runs of different world sizes to 1e-6; correct counts stay exact integers.
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self._correct = torch.zeros((), dtype=torch.int64, device=device)
        self._count = 0
        self._confusion = None if num_classes is None else torch.zeros(
            num_classes, num_classes, dtype=torch.int64, device=device
        )

    def reset(self) -> None:
        self._loss_sum.zero_()
        self._correct.zero_()
        self._count = 0
        if self._confusion is not None:
            self._confusion.zero_()

    @torch.no_grad()
    def update(self, logits: torch.Tensor, targets: torch.Tensor, loss_sum: torch.Tensor) -> None:
        """Add a batch: `loss_sum` is the batch's summed (not mean) per-sample loss."""
        predictions = logits.argmax(dim=1)
        self._loss_sum += loss_sum.detach()
        self._correct += (predictions == targets).sum()
        self._count += targets.shape[0]
        if self._confusion is not None:
            # Cell (true, predicted) is bin true * C + predicted: one bincount per batch, on the device.
            classes = self._confusion.shape[0]
            cells = torch.bincount(targets * classes + predictions, minlength=classes * classes)
            self._confusion += cells.view(classes, classes)

    def totals(self) -> torch.Tensor:
        """This rank's (loss sum, correct, count) so far, then the confusion counts row by row if
        counted: one vector, so one all-reduce carries them all. Also the baseline of a window."""
        totals = torch.stack([self._loss_sum, self._correct.double(), self._loss_sum.new_tensor(self._count)])
        if self._confusion is None:
            return totals
        # float64 holds integer counts exactly up to 2**53.
        return torch.cat([totals, self._confusion.flatten().double()])

    def compute_totals(self) -> list[float]:
        """(loss sum, correct, count) over all ranks: what a checkpoint keeps of an unfinished epoch.
        A collective."""
        return all_reduce_sum(self.totals()).tolist()

    def add_totals(self, totals: list[float]) -> None:
        """Add totals saved by `compute_totals` (on one rank only, or they count twice)."""
        loss_sum, correct, count = totals
        self._loss_sum += loss_sum
        self._correct += int(correct)
        self._count += int(count)

    def compute(self, baseline: torch.Tensor | None = None) -> dict[str, Any]:
        """`loss`, `acc` and `count` over all ranks' samples (since `baseline`, if given), and
        `confusion` (a C x C int64 CPU tensor of counts) when the classes are counted.

        A collective: call it on every rank.
        """
        totals = self.totals() if baseline is None else self.totals() - baseline
        reduced = all_reduce_sum(totals).cpu()
        loss_sum, correct, count = reduced[:3].tolist()
        result: dict[str, Any] = {"loss": float("nan"), "acc": float("nan"), "count": 0}
        if count > 0:
            result = {"loss": loss_sum / count, "acc": correct / count, "count": int(count)}
        if self._confusion is not None:
            # Sliced, not "the rest": a metric added later appends its sums after these.
            result["confusion"] = reduced[3 : 3 + self._confusion.numel()].view(self._confusion.shape).long()
        return result
