"""A damaged newest checkpoint: `resume=auto` goes on from the newest one that loads and ends
exactly where an uninterrupted run ends; the ranks resume from one file chosen by rank 0, or
none of them trains at all."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from src import checkpoint
from src.checkpoint import layout, resume
from src.checkpoint.file_store import FileStore
from src.common.errors import UsageError


def save(saver: FileStore, step: int) -> None:
    saver.save({"model": {"w": torch.full((2,), float(step))}, "loop": {"epoch": 0, "step": step}, "config": {}},
               step, is_best=False, mid_epoch=True)


def load(saver: FileStore, resume_setting: str) -> checkpoint.store.Checkpoint | None:
    return resume.load_resume_checkpoint(saver.directory, saver.is_main_process, resume_setting, allowed=set())


def test_auto_takes_the_newest_checkpoint_that_loads(tmp_path: Path):
    saver = FileStore(tmp_path, is_main_process=True, keep_last=3)
    for step in (5, 10, 15):
        save(saver, step)
    assert [p.name for p in layout.newest_first(tmp_path)] == ["last.pt", "step_000000015.pt", "step_000000010.pt",
                                                                "step_000000005.pt"]
    (tmp_path / "last.pt").write_bytes(b"")
    (tmp_path / "step_000000015.pt").write_bytes(b"PK\x03\x04 cut")
    chosen = load(saver, "auto")
    assert chosen.path == tmp_path / "step_000000010.pt" and chosen.loop["step"] == 10


def test_auto_with_every_checkpoint_damaged_is_one_error(tmp_path: Path):
    saver = FileStore(tmp_path, is_main_process=True)
    save(saver, 5)
    for path in layout.newest_first(saver.directory):
        path.write_bytes(b"")
    with pytest.raises(UsageError, match=r"last.pt cannot be read .*; nor does any older one in"):
        load(saver, "auto")


def test_an_explicit_damaged_path_is_an_error_not_a_fallback(tmp_path: Path):
    saver = FileStore(tmp_path, is_main_process=True)
    save(saver, 5)
    (tmp_path / "last.pt").write_bytes(b"")
    with pytest.raises(UsageError, match="cannot be read"):
        load(saver, str(tmp_path / "last.pt"))
    assert load(saver, "auto").loop["step"] == 5
    assert checkpoint.read(tmp_path / "step_000000005.pt").loop["step"] == 5
