"""src/reports/reporting.py: per-rank log files, metrics.json, and what only rank 0 writes."""

import io
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

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


def test_model_summary_lists_parameters_per_child_and_in_all():
    model = nn.Sequential()
    model.add_module("encoder", nn.Linear(4, 3))
    model.add_module("act", nn.ReLU())
    model.add_module("head", nn.Linear(3, 2))
    model.encoder.requires_grad_(False)
    text = reporting.model_summary({"model": model})
    assert "| encoder | Linear | 15 |" in text and "| act | ReLU | 0 |" in text and "| head | Linear | 8 |" in text
    assert "| **total** | Sequential | 23 (8 trainable) |" in text
    assert "    (encoder): Linear(in_features=4, out_features=3, bias=True)" in text
    assert reporting.parameter_counts(model) == (23, 8)


def test_other_ranks_draw_no_images_and_write_no_files(tmp_path: Path):
    reporter = reporting.Reporter(tmp_path, is_main_process=False)
    reporter.text("model/summary", reporting.model_summary({"model": nn.Linear(2, 2)}))
    reporter.image("inputs/train_batch", torch.zeros(3, 8, 8), step=0)
    reporter.file("confusion_matrix.csv", "a,b\n")
    assert not reporter.shows_images
    reporter.close()
    assert list(tmp_path.iterdir()) == []


def test_main_process_writes_images_text_and_files(tmp_path: Path):
    reporter = reporting.Reporter(tmp_path, is_main_process=True)
    reporter.text("model/summary", reporting.model_summary({"model": nn.Linear(4, 2)}))
    image = torch.rand(3, 10, 12, generator=torch.Generator().manual_seed(0))
    reporter.image("val/some_image", image, step=7)
    reporter.file("table.csv", "true\\predicted,0,1\n")
    reporter.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    shown = events.Images("val/some_image")[0]
    decoded = torch.from_numpy(np.array(Image.open(io.BytesIO(shown.encoded_image_string)).convert("RGB")))
    assert shown.step == 7 and (decoded - image.permute(1, 2, 0) * 255).abs().max() < 1  # 8-bit pixels
    summary = events.Tensors("model/summary/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| **total** | Linear | 10 (10 trainable) |" in summary
    assert (tmp_path / "table.csv").read_text() == "true\\predicted,0,1\n"


def test_run_start_logs_the_resolved_config_then_one_summary_line(tmp_path: Path, caplog):
    runtime = SimpleNamespace(world_size=2, device=torch.device("cpu"), backend="gloo")
    sampler = SimpleNamespace(global_batch_size=64, micro_batch_size=16, steps_per_epoch=22)
    splits = SimpleNamespace(train=range(1437), val=range(180), test=range(180))
    data = SimpleNamespace(train_sampler=sampler, splits=splits)
    config = {"model": {"_target_": "src.components.models.MLP", "hidden_sizes": [8]},
              "task": {"_target_": "src.components.tasks.Binary"},
              "trainer": {"epochs": 3, "monitor": "val/f1", "monitor_mode": "max"}}
    with caplog.at_level(logging.INFO, logger="train"):
        reporting.log_run_start(tmp_path, runtime, {"model": nn.Linear(4, 2)}, data, 2, config, ["trainer.epochs=3"])
    overrides_record, config_record, summary_record = caplog.records
    assert overrides_record.getMessage() == "overrides: trainer.epochs=3"
    assert config_record.console is False  # the log files only (print_config=true: the console too)
    assert config_record.getMessage() == (
        "config:\nmodel:\n  _target_: src.components.models.MLP\n  hidden_sizes:\n  - 8\n"
        "task:\n  _target_: src.components.tasks.Binary\n"
        "trainer:\n  epochs: 3\n  monitor: val/f1\n  monitor_mode: max"
    )
    line = summary_record.getMessage()
    for part in ("world size 2", "device cpu", "backend gloo", "task Binary (best.pt by val/f1, max)",
                 "Linear (10 parameters, 10 trainable)",
                 "1437 train / 180 val / 180 test samples", "global batch 64 = 2 ranks x 16 per rank x 2 accum",
                 "22 steps/epoch"):
        assert part in line, line
    data.splits = SimpleNamespace(train=range(1437), val=range(360))  # a fork's dataset without a test split
    with caplog.at_level(logging.INFO, logger="train"):
        reporting.log_run_start(tmp_path, runtime, {"model": nn.Linear(4, 2)}, data, 2, config, ["trainer.epochs=3"])
    assert "1437 train / 360 val samples, no test split" in caplog.records[-1].getMessage()
