"""A damaged newest checkpoint: `resume=auto` goes on from the newest one that loads and ends
exactly where an uninterrupted run ends; the ranks resume from one file chosen by rank 0, or
none of them trains at all."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from src.common.errors import UsageError
from src.loop import checkpoint, resume
from src.loop.checkpoint import Checkpointer


def save(saver: Checkpointer, step: int) -> None:
    saver.save({"model": {"w": torch.full((2,), float(step))}, "epoch": 0, "step": step, "config": {}},
               is_best=False, step=step)


def test_auto_takes_the_newest_checkpoint_that_loads(tmp_path: Path):
    saver = Checkpointer(tmp_path, is_main_process=True, keep_last=3)
    for step in (5, 10, 15):
        save(saver, step)
    assert [p.name for p in saver.newest_first()] == ["last.pt", "step_000000015.pt", "step_000000010.pt",
                                                       "step_000000005.pt"]
    saver.last_path.write_bytes(b"")
    (tmp_path / "step_000000015.pt").write_bytes(b"PK\x03\x04 cut")
    path, payload = resume.load_resume_checkpoint(saver, "auto", allowed=set())
    assert path == tmp_path / "step_000000010.pt" and payload["step"] == 10


def test_auto_with_every_checkpoint_damaged_is_one_error(tmp_path: Path):
    saver = Checkpointer(tmp_path, is_main_process=True)
    save(saver, 5)
    for path in saver.newest_first():
        path.write_bytes(b"")
    with pytest.raises(UsageError, match=r"last.pt cannot be read .*; nor does any older one in"):
        resume.load_resume_checkpoint(saver, "auto", allowed=set())


def test_an_explicit_damaged_path_is_an_error_not_a_fallback(tmp_path: Path):
    saver = Checkpointer(tmp_path, is_main_process=True)
    save(saver, 5)
    saver.last_path.write_bytes(b"")
    with pytest.raises(UsageError, match="cannot be read"):
        resume.load_resume_checkpoint(saver, str(saver.last_path), allowed=set())
    assert resume.load_resume_checkpoint(saver, "auto", allowed=set())[1]["step"] == 5
    assert checkpoint.load(tmp_path / "step_000000005.pt")["step"] == 5
