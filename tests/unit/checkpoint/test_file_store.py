"""Checkpoint files (src/checkpoint/file_store.py, writing.py, layout.py): atomic writes, safe loading, resume
decisions."""

import errno
import os
from pathlib import Path

import pytest
import torch

from src import checkpoint
from src.checkpoint import layout, writing
from src.checkpoint.file_store import FileStore
from src.checkpoint.states import ModelState, Named
from src.checkpoint.store import FORMAT
from src.common import files
from src.common.errors import UsageError


def payload(value: float) -> dict:
    """Parts by name, as the trainer hands them to the store (here as plain states)."""
    return {"model": {"w": torch.full((3,), value)}, "loop": {"epoch": 1, "step": 10}}


def save(saver: FileStore, value: float, is_best: bool, step: int = 10, mid_epoch: bool = False) -> None:
    saver.save(payload(value), step, is_best, mid_epoch)


def test_save_writes_last_and_copies_best(tmp_path: Path):
    saver = FileStore(tmp_path / "checkpoints", is_main_process=True)
    save(saver, 1.0, is_best=True)
    save(saver, 2.0, is_best=False)
    assert checkpoint.read(saver.directory / "last.pt").state["model"]["w"].tolist() == [2.0, 2.0, 2.0]
    assert checkpoint.read(saver.directory / "best.pt").state["model"]["w"].tolist() == [1.0, 1.0, 1.0]
    assert sorted(p.name for p in saver.directory.iterdir()) == ["best.pt", "last.pt"]


def test_only_the_main_process_writes(tmp_path: Path):
    save(FileStore(tmp_path / "checkpoints", is_main_process=False), 1.0, is_best=True)
    assert not (tmp_path / "checkpoints").exists()


def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch):
    saver = FileStore(tmp_path, is_main_process=True)
    save(saver, 1.0, is_best=False)

    def crash(obj, f):
        f.write(b"half a file")  # save_atomic hands torch.save its temp file, open
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        save(saver, 2.0, is_best=False)
    assert checkpoint.read(tmp_path / "last.pt").state["model"]["w"].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "content,message",
    [(b"", "cannot be read"), (b"not a zip", "cannot be read"), (None, "not a checkpoint of this template")],
)
def test_bad_files_give_one_clear_error(tmp_path: Path, content, message):
    path = tmp_path / "x.pt"
    if content is None:
        torch.save({"state_dict": {}}, path)
    else:
        path.write_bytes(content)
    with pytest.raises(UsageError, match=message) as error:
        checkpoint.read(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_truncated_checkpoint_is_refused(tmp_path: Path):
    saver = FileStore(tmp_path, is_main_process=True)
    save(saver, 1.0, is_best=False)
    last = tmp_path / "last.pt"
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 2])
    with pytest.raises(UsageError, match="cannot be read"):
        checkpoint.read(last)


def test_loading_never_runs_code_from_the_file(tmp_path: Path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "evil.pt"
    torch.save({"format": FORMAT, "x": Evil()}, path)
    with pytest.raises(UsageError, match="cannot be read"):
        checkpoint.read(path)


def test_missing_checkpoint_names_the_path(tmp_path: Path):
    with pytest.raises(UsageError) as error:
        checkpoint.read(tmp_path / "nope.pt")
    assert str(error.value) == f"checkpoint {tmp_path / 'nope.pt'} does not exist"


def test_a_ddp_checkpoint_named_without_pt_is_named_with_it(tmp_path: Path):
    saver = FileStore(tmp_path / "checkpoints", is_main_process=True)
    save(saver, 1.0, is_best=True)
    with pytest.raises(UsageError) as error:
        checkpoint.read(saver.directory / "best")
    assert str(error.value) == (f"checkpoint {saver.directory / 'best'} does not exist; {saver.directory / 'best.pt'} "
                                "does (dist=ddp runs write .pt files, dist=fsdp runs folders without .pt)")


def test_model_mismatch_names_the_file(tmp_path: Path):
    saver = FileStore(tmp_path, is_main_process=True)
    saver.save({"models": {"model": {"weight": torch.zeros(5, 2)}}}, step=1, is_best=False)
    with pytest.raises(UsageError, match=f"checkpoint {tmp_path / 'last.pt'} does not fit this model"):
        checkpoint.read(tmp_path / "last.pt").restore({"models": Named({"model": ModelState(torch.nn.Linear(2, 3))},
                                                                       "model")})


def test_resume_decisions(tmp_path: Path):
    directory = tmp_path / "checkpoints"
    assert layout.resume_path(directory, None) is None
    assert layout.resume_path(directory, "auto") is None
    assert layout.resume_path(directory, "some/file.pt") == Path("some/file.pt")
    save(FileStore(directory, is_main_process=True), 1.0, is_best=False)
    assert layout.resume_path(directory, "auto") == directory / "last.pt"
    with pytest.raises(UsageError, match="already holds a run; pass resume=auto"):
        layout.resume_path(directory, None)


def test_saves_fsync_the_file_and_its_directory(tmp_path: Path, monkeypatch):
    """Durable, not only atomic: each file written (last.pt, best.pt, step_<N>.pt, metrics.json)
    is fsync'ed before its rename and its directory after it."""
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    saver = FileStore(tmp_path, is_main_process=True)
    save(saver, 1.0, is_best=True, step=10, mid_epoch=True)
    files.write_text_atomically(tmp_path / "metrics.json", "{}")
    written = ["last.pt", "best.pt", "step_000000010.pt", "metrics.json"]
    assert synced == [entry for name in written for entry in (f"{tmp_path / name}.tmp", str(tmp_path))]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(written)


def test_no_room_on_disk_is_one_line_with_the_bytes_needed(tmp_path: Path, monkeypatch):
    saver = FileStore(tmp_path, is_main_process=True)
    save(saver, 1.0, is_best=False)
    last = tmp_path / "last.pt"
    before = last.read_bytes()
    real_save = torch.save

    def disk_full(obj, f):
        if not hasattr(f, "name"):  # the byte count of the error message
            return real_save(obj, f)
        f.write(b"part of it")
        try:  # as torch.save reports it: a RuntimeError whose context is the OSError
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from None

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(UsageError) as error:
        save(saver, 2.0, is_best=False)
    monkeypatch.undo()
    needed = writing.serialized_size({"format": FORMAT, **payload(2.0)})
    assert f"it needs {needed:,} bytes" in str(error.value) and "No space left on device" in str(error.value)
    assert last.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]  # no temp file left behind


def test_the_byte_count_is_the_file_size(tmp_path: Path):
    writing.save_atomic(payload(3.0), tmp_path / "a.pt")
    assert writing.serialized_size(payload(3.0)) == (tmp_path / "a.pt").stat().st_size
