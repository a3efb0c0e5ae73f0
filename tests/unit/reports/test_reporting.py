"""src/reports/reporting.py: per-rank log files, metrics.json, and what only rank 0 writes."""

import csv
import io
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import TensorDataset

from src.components.tasks import Classification
from src.data.splits import DataSplits
from src.reports import reporting


def test_main_process_writes_metrics_json_and_tensorboard(tmp_path: Path):
    reporter = reporting.Reporter(tmp_path, is_main_process=True)
    reporter.scalars({"train/loss": 1.5}, step=3)
    reporter.write_metrics({"val/acc": 0.5})
    reporter.write_metrics({"val/acc": 0.75})
    reporter.close()
    assert json.loads((tmp_path / "metrics.json").read_text()) == {"val/acc": 0.75}
    assert not list(tmp_path.glob("*.tmp"))
    assert list((tmp_path / "tb").glob("events.out.tfevents*"))


def test_other_ranks_write_nothing(tmp_path: Path):
    reporter = reporting.Reporter(tmp_path, is_main_process=False)
    reporter.scalars({"train/loss": 1.5}, step=3)
    reporter.hparams({"lr": 0.1}, {"val/acc": 0.5})
    reporter.write_metrics({"val/acc": 0.5})
    reporter.close()
    assert list(tmp_path.iterdir()) == []


def test_each_rank_logs_to_its_own_file(tmp_path: Path, capsys):
    try:
        reporting.setup_logging(tmp_path, rank=1)
        logging.getLogger("x").info("hello from rank 1")
        logging.getLogger("x").warning("careful")
        reporting.setup_logging(tmp_path, rank=0)
        logging.getLogger("x").info("hello from rank 0")
    finally:
        for handler in list(logging.getLogger().handlers):
            handler.close()
            logging.getLogger().removeHandler(handler)
    assert "hello from rank 1" in (tmp_path / "train.rank1.log").read_text()
    assert "hello from rank 0" in (tmp_path / "train.log").read_text()
    assert "hello from rank 1" not in (tmp_path / "train.log").read_text()
    captured = capsys.readouterr()
    assert "hello from rank 0" in captured.out and "hello from rank 1" not in captured.out + captured.err
    assert "[rank 1]" in captured.err and "careful" in captured.err


def image_splits(dataset: TensorDataset) -> DataSplits:
    return DataSplits(train=dataset, val=dataset, info={"num_classes": 2, "in_channels": 1, "image_size": [8, 8]})


def test_no_input_grid_where_inputs_are_not_images(tmp_path: Path):
    reporter = reporting.Reporter(tmp_path, is_main_process=True)
    vectors = TensorDataset(torch.randn(8, 30), torch.zeros(8))
    reporter.input_images(DataSplits(vectors, vectors, {"num_classes": 2, "num_features": 30}), [[0, 1]],
                          Classification())
    masks = TensorDataset(torch.randn(8, 5, 8, 8), torch.zeros(8))  # 5 channels: not an image to show
    reporter.input_images(image_splits(masks), [[0, 1]], Classification())
    reporter.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert events.Tags()["images"] == []


def test_other_ranks_draw_no_images_and_write_no_confusion_matrix(tmp_path: Path):
    reporter = reporting.Reporter(tmp_path, is_main_process=False)
    reporter.model_summary(nn.Linear(2, 2))
    reporter.input_images(image_splits(TensorDataset(torch.zeros(4, 1, 8, 8))), [[0, 1]], Classification())
    reporter.confusion_matrix(torch.eye(3, dtype=torch.int64), step=1)
    reporter.close()
    assert list(tmp_path.iterdir()) == []


def test_confusion_heatmap_colours_each_cell_by_its_share_of_the_true_class():
    counts = torch.tensor([[3, 1, 0], [0, 0, 0], [0, 2, 2]])
    image = reporting.confusion_heatmap(counts)
    side = 32  # pixels per cell for a few classes, plus 1-pixel grid lines
    assert image.shape == (3, 3 * (side + 1) + 1, 3 * (side + 1) + 1)
    empty, full = torch.tensor(reporting.EMPTY_CELL_RGB), torch.tensor(reporting.FULL_CELL_RGB)

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
    assert all((line == reporting.GRID_RGB_VALUE).all() for line in grid_lines)
    many = reporting.confusion_heatmap(torch.ones(100, 100, dtype=torch.int64))
    assert many.shape == (3, 100 * 6 + 1, 100 * 6 + 1)  # cells shrink to keep the image near 512 pixels


def test_confusion_csv_has_true_classes_as_rows_and_raw_counts():
    text = reporting.confusion_csv(torch.tensor([[5, 1], [0, 7]]))
    assert list(csv.reader(io.StringIO(text))) == [["true\\predicted", "0", "1"], ["0", "5", "1"], ["1", "0", "7"]]


def test_image_grid_scales_each_image_to_its_own_range_and_enlarges_small_ones():
    images = torch.stack([torch.arange(64.0).view(1, 8, 8) * scale - offset
                          for scale, offset in [(1, 0), (0.01, 3), (-5, -1)]])
    grid = reporting.image_grid(images)
    tile, pad = 32, 2  # 8 pixels enlarged 4 times; make_grid's default padding
    assert grid.shape == (3, tile + 2 * pad, 3 * (tile + pad) + pad)
    for index in range(3):
        left = pad + index * (tile + pad)
        shown = grid[:, pad:pad + tile, left:left + tile]
        assert shown.min() == 0 and shown.max() == 1  # every image uses the whole range
        assert (shown[0] == shown[1]).all()  # grey: one channel repeated
        assert (shown[:, :4, :4] == shown[:, 0, 0].view(3, 1, 1)).all()  # a pixel became 4x4
    first = grid[0, pad:pad + tile:4, pad:pad + tile:4]
    assert torch.allclose(first, torch.arange(64.0).view(8, 8) / 63)


def test_model_summary_lists_parameters_per_child_and_in_all():
    model = nn.Sequential()
    model.add_module("encoder", nn.Linear(4, 3))
    model.add_module("act", nn.ReLU())
    model.add_module("head", nn.Linear(3, 2))
    model.encoder.requires_grad_(False)
    text = reporting.model_summary(model)
    assert "| encoder | Linear | 15 |" in text and "| act | ReLU | 0 |" in text and "| head | Linear | 8 |" in text
    assert "| **total** | Sequential | 23 (8 trainable) |" in text
    assert "    (encoder): Linear(in_features=4, out_features=3, bias=True)" in text
    assert reporting.parameter_counts(model) == (23, 8)


def test_main_process_writes_images_text_and_confusion_csv(tmp_path: Path):
    reporter = reporting.Reporter(tmp_path, is_main_process=True)
    reporter.model_summary(nn.Linear(4, 2))
    dataset = TensorDataset(torch.randn(40, 1, 8, 8), torch.zeros(40))
    reporter.input_images(image_splits(dataset), [list(range(10, 30)), list(range(10))], Classification())
    counts = torch.tensor([[4, 0], [1, 3]])
    reporter.confusion_matrix(counts, step=7)
    reporter.close()

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["images"]) == {"inputs/train_batch", "val/confusion_matrix"}
    inputs = events.Images("inputs/train_batch")[0]
    assert (inputs.width, inputs.height, inputs.step) == (8 * 34 + 2, 2 * 34 + 2, 0)  # 16 of 20: two rows
    matrix = events.Images("val/confusion_matrix")[0]
    decoded = torch.from_numpy(np.array(Image.open(io.BytesIO(matrix.encoded_image_string)).convert("RGB")))
    expected = reporting.confusion_heatmap(counts).permute(1, 2, 0) * 255
    assert matrix.step == 7 and (decoded - expected).abs().max() < 1  # TensorBoard stores 8-bit pixels
    summary = events.Tensors("model/summary/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| **total** | Linear | 10 (10 trainable) |" in summary
    assert (tmp_path / "confusion_matrix.csv").read_text() == "true\\predicted,0,1\n0,4,0\n1,1,3\n"


def test_run_start_logs_the_resolved_config_then_one_summary_line(tmp_path: Path, caplog):
    runtime = SimpleNamespace(world_size=2, device=torch.device("cpu"), backend="gloo")
    sampler = SimpleNamespace(global_batch_size=64, micro_batch_size=16, steps_per_epoch=22)
    splits = SimpleNamespace(train=range(1437), val=range(360))
    data = SimpleNamespace(train_sampler=sampler, splits=splits)
    config = {"model": {"_target_": "src.components.models.MLP", "hidden_sizes": [8]},
              "task": {"_target_": "src.components.tasks.Binary"},
              "trainer": {"epochs": 3, "monitor": "val/f1", "monitor_mode": "max"}}
    with caplog.at_level(logging.INFO, logger="train"):
        reporting.log_run_start(tmp_path, runtime, nn.Linear(4, 2), data, 2, config)
    config_record, summary_record = caplog.records
    assert config_record.getMessage() == (
        "config:\nmodel:\n  _target_: src.components.models.MLP\n  hidden_sizes:\n  - 8\n"
        "task:\n  _target_: src.components.tasks.Binary\n"
        "trainer:\n  epochs: 3\n  monitor: val/f1\n  monitor_mode: max"
    )
    line = summary_record.getMessage()
    for part in ("world size 2", "device cpu", "backend gloo", "task Binary (best.pt by val/f1, max)",
                 "Linear (10 parameters, 10 trainable)",
                 "1437 train / 360 val samples", "global batch 64 = 2 ranks x 16 per rank x 2 accum", "22 steps/epoch"):
        assert part in line, line


@pytest.mark.parametrize("count,channels,columns,padding", [(5, 1, 8, 2), (16, 3, 8, 2), (9, 3, 3, 1)])
def test_tile_is_torchvisions_make_grid(count, channels, columns, padding):
    from torchvision.utils import make_grid

    from src.reports.reporting import tile

    images = torch.rand(count, channels, 6, 7, generator=torch.Generator().manual_seed(count))
    expected = make_grid(images, nrow=columns, padding=padding, pad_value=0.25)
    assert torch.equal(tile(images, columns=columns, padding=padding, pad_value=0.25), expected)
