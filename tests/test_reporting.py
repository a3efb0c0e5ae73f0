"""src/reporting.py: per-rank log files, metrics.json, and what only rank 0 writes."""

import json
import logging
from pathlib import Path

from src import reporting


def test_flatten_turns_nested_config_into_dotted_scalars():
    flat = reporting.flatten({"optimizer": {"lr": 0.1, "betas": [0.9, 0.99]}, "seed": 0, "resume": None})
    assert flat == {"optimizer.lr": 0.1, "optimizer.betas": "[0.9, 0.99]", "seed": 0, "resume": "None"}


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
