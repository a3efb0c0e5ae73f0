"""Classification metrics that are exact under DDP.

Each rank accumulates sums on its device (summed loss, correct predictions) and a
sample count, with no host sync per step. `compute()` all-reduces the three totals in
one collective, so the result is the sample-weighted mean over every rank's samples:
not a mean of per-rank means, not rank 0's value.
"""

from __future__ import annotations

import torch

from src.distributed import all_reduce_sum


class ClassificationMetrics:
    """Running loss and accuracy over the samples seen since the last `reset()`."""

    def __init__(self, device: torch.device) -> None:
        # float64 keeps sums of thousands of per-sample losses exact enough to compare
        # runs of different world sizes to 1e-6; correct counts stay exact integers.
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self._correct = torch.zeros((), dtype=torch.int64, device=device)
        self._count = 0

    def reset(self) -> None:
        self._loss_sum.zero_()
        self._correct.zero_()
        self._count = 0

    @torch.no_grad()
    def update(self, logits: torch.Tensor, targets: torch.Tensor, loss_sum: torch.Tensor) -> None:
        """Add a batch: `loss_sum` is the batch's summed (not mean) per-sample loss."""
        self._loss_sum += loss_sum.detach()
        self._correct += (logits.argmax(dim=1) == targets).sum()
        self._count += targets.shape[0]

    def totals(self) -> torch.Tensor:
        """This rank's (loss sum, correct, count) so far, e.g. as the baseline of a window."""
        return torch.stack([self._loss_sum, self._correct.double(), self._loss_sum.new_tensor(self._count)])

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

    def compute(self, baseline: torch.Tensor | None = None) -> dict[str, float]:
        """`loss`, `acc` and `count` over all ranks' samples (since `baseline`, if given).

        A collective: call it on every rank.
        """
        totals = self.totals() if baseline is None else self.totals() - baseline
        loss_sum, correct, count = all_reduce_sum(totals).tolist()
        if count == 0:
            return {"loss": float("nan"), "acc": float("nan"), "count": 0}
        return {"loss": loss_sum / count, "acc": correct / count, "count": int(count)}
