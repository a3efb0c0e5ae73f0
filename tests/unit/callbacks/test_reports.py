"""The callbacks that show people something (src/callbacks/confusion_matrix.py, input_grid.py): through the
Reporter's methods, on rank 0 only."""

import csv
import io
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import TensorDataset

from src.callbacks.confusion_matrix import (
    EMPTY_CELL_RGB,
    FULL_CELL_RGB,
    GRID_RGB_VALUE,
    ConfusionMatrix,
    confusion_csv,
    confusion_heatmap,
)
from src.callbacks.input_grid import InputGrid
from src.components.tasks import Classification
from src.data.splits import DataSplits
from src.reports import reporting


def run_of(reporter: reporting.Reporter, splits: DataSplits | None = None, batches=(), step: int = 0):
    """What the two callbacks read of a run: its reporter, data and task, and the step."""
    data = SimpleNamespace(splits=splits, train_sampler=list(batches))
    return SimpleNamespace(parts=SimpleNamespace(reporter=reporter, data=data, task=Classification()),
                           state=SimpleNamespace(step=step))


def image_splits(dataset: TensorDataset) -> DataSplits:
    return DataSplits(train=dataset, val=dataset, info={"num_classes": 2, "in_channels": 1, "image_size": [8, 8]})


def test_no_input_grid_where_inputs_are_not_images(tmp_path: Path):
    reporter = reporting.Reporter(tmp_path, is_main_process=True)
    vectors = TensorDataset(torch.randn(8, 30), torch.zeros(8))
    InputGrid(count=16).on_run_start(run_of(reporter, DataSplits(vectors, vectors, {"num_classes": 2,
                                                                                      "num_features": 30}), [[0, 1]]))
    masks = TensorDataset(torch.randn(8, 5, 8, 8), torch.zeros(8))  # 5 channels: not an image to show
    InputGrid(count=16).on_run_start(run_of(reporter, image_splits(masks), [[0, 1]]))
    reporter.scalars({"lr": 0.1}, step=1)  # an event, so the events file exists
    reporter.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert events.Tags()["images"] == []


def test_other_ranks_draw_no_images_and_write_no_confusion_matrix(tmp_path: Path):
    reporter = reporting.Reporter(tmp_path, is_main_process=False)
    InputGrid(count=16).on_run_start(run_of(reporter, image_splits(TensorDataset(torch.zeros(4, 1, 8, 8))), [[0, 1]]))
    ConfusionMatrix().on_validation(run_of(reporter, step=1), {"confusion": torch.eye(3, dtype=torch.int64)})
    reporter.close()
    assert list(tmp_path.iterdir()) == []


def test_confusion_heatmap_colours_each_cell_by_its_share_of_the_true_class():
    counts = torch.tensor([[3, 1, 0], [0, 0, 0], [0, 2, 2]])
    image = confusion_heatmap(counts)
    side = 32  # pixels per cell for a few classes, plus 1-pixel grid lines
    assert image.shape == (3, 3 * (side + 1) + 1, 3 * (side + 1) + 1)
    empty, full = torch.tensor(EMPTY_CELL_RGB), torch.tensor(FULL_CELL_RGB)

    def cell(row: int, col: int) -> torch.Tensor:
        top, left = 1 + row * (side + 1), 1 + col * (side + 1)
        block = image[:, top:top + side, left:left + side]
        assert (block == block[:, :1, :1]).all()  # one colour per cell
        return block[:, 0, 0]

    expected_shares = [[0.75, 0.25, 0.0], [0.0, 0.0, 0.0], [0.0, 0.5, 0.5]]  # a class never seen stays white
    for row, shares in enumerate(expected_shares):
        for col, share in enumerate(shares):
            assert torch.allclose(cell(row, col), empty + share * (full - empty)), (row, col)
    grid_lines = [image[:, 0, :], image[:, :, side + 1], image[:, -1, :]]
    assert all((line == GRID_RGB_VALUE).all() for line in grid_lines)
    many = confusion_heatmap(torch.ones(100, 100, dtype=torch.int64))
    assert many.shape == (3, 100 * 6 + 1, 100 * 6 + 1)  # cells shrink to keep the image near 512 pixels


def test_confusion_csv_has_true_classes_as_rows_and_raw_counts():
    text = confusion_csv(torch.tensor([[5, 1], [0, 7]]))
    assert list(csv.reader(io.StringIO(text))) == [["true\\predicted", "0", "1"], ["0", "5", "1"], ["1", "0", "7"]]


def test_main_process_writes_the_input_grid_and_the_confusion_matrix(tmp_path: Path):
    reporter = reporting.Reporter(tmp_path, is_main_process=True)
    dataset = TensorDataset(torch.randn(40, 1, 8, 8), torch.zeros(40))
    InputGrid(count=16).on_run_start(run_of(reporter, image_splits(dataset), [list(range(10, 30)), list(range(10))]))
    counts = torch.tensor([[4, 0], [1, 3]])
    ConfusionMatrix().on_validation(run_of(reporter, step=7), {"confusion": counts, "acc": 0.875})
    ConfusionMatrix().on_validation(run_of(reporter, step=8), {"acc": 0.9})  # a task without one: nothing
    reporter.close()

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["images"]) == {"inputs/train_batch", "val/confusion_matrix"}
    inputs = events.Images("inputs/train_batch")[0]
    assert (inputs.width, inputs.height, inputs.step) == (8 * 34 + 2, 2 * 34 + 2, 0)  # 16 of 20: two rows
    matrix = events.Images("val/confusion_matrix")[0]
    decoded = torch.from_numpy(np.array(Image.open(io.BytesIO(matrix.encoded_image_string)).convert("RGB")))
    expected = confusion_heatmap(counts).permute(1, 2, 0) * 255
    assert matrix.step == 7 and (decoded - expected).abs().max() < 1  # TensorBoard stores 8-bit pixels
    assert len(events.Images("val/confusion_matrix")) == 1
    assert (tmp_path / "confusion_matrix.csv").read_text() == "true\\predicted,0,1\n0,4,0\n1,1,3\n"


