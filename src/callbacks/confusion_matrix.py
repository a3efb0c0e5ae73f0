"""The val split's confusion matrix, every epoch: a heatmap in TensorBoard (`val/confusion_matrix`) and the raw
counts in the run dir's `confusion_matrix.csv` (rows: true class, columns: predicted). The counts are the task's
all-reduced val sum `confusion`, so the matrix is exact under DDP; tasks without one show nothing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from src.loop.callback import Callback, Run
from src.reports.images import tile

EMPTY_CELL_RGB = (1.0, 1.0, 1.0)
FULL_CELL_RGB = (0.03, 0.19, 0.42)
GRID_RGB_VALUE = 0.6  # grey lines between the cells
CSV_FILE = "confusion_matrix.csv"


class ConfusionMatrix(Callback):
    def on_validation(self, run: Run, val: Mapping[str, Any]) -> None:
        if (counts := val.get("confusion")) is not None:
            run.parts.reporter.image("val/confusion_matrix", confusion_heatmap(counts), run.state.step)
            run.parts.reporter.file(CSV_FILE, confusion_csv(counts))


def confusion_heatmap(counts: torch.Tensor, max_side: int = 512) -> torch.Tensor:
    """A (3, H, W) image in [0, 1] of a C x C confusion matrix, each row normalised: a cell's colour is the share
    of its true class predicted as its column, from EMPTY_CELL_RGB (none) to FULL_CELL_RGB (all)."""
    classes = counts.shape[0]
    shares = counts.double() / counts.sum(dim=1, keepdim=True).clamp(min=1)  # a class never seen: all white
    empty, full = torch.tensor(EMPTY_CELL_RGB), torch.tensor(FULL_CELL_RGB)
    colours = empty + shares.float().unsqueeze(-1) * (full - empty)  # (C, C, 3)
    side = max(1, min(32, max_side // classes))
    cells = colours.view(classes * classes, 3, 1, 1).expand(-1, -1, side, side)
    return tile(cells, columns=classes, padding=1, pad_value=GRID_RGB_VALUE)


def confusion_csv(counts: torch.Tensor) -> str:
    """The matrix as CSV: a header of predicted classes, then one row per true class with its raw counts."""
    classes = range(counts.shape[0])
    lines = ["true\\predicted," + ",".join(map(str, classes))]
    lines += [f"{true}," + ",".join(str(n) for n in row) for true, row in zip(classes, counts.tolist())]
    return "\n".join(lines) + "\n"
