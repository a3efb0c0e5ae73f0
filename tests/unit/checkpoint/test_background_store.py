"""trainer.async_checkpoint in one process (src/checkpoint/store.py): a save returns once the state is copied,
the writer thread writes that copy, at most one write is in flight, its failure is raised by the next wait,
and after training failed the run waits for the write without raising it. Several ranks, kills and full disks:
tests/integration/test_fsdp_cli.py, test_fault_tolerance.py."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

from src.checkpoint.file_store import FileStore


class GatedStore(FileStore):
    """A FileStore whose writes wait for `gate` (a slow disk), and fail with `failure` if it is set."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, is_main_process=True, background=True)
        self.gate, self.failure, self.writing = threading.Event(), None, threading.Event()

    def write(self, payload, step: int, is_best: bool, mid_epoch: bool) -> None:  # noqa: ANN001
        self.writing.set()
        assert self.gate.wait(timeout=30)
        if self.failure is not None:
            raise self.failure
        super().write(payload, step, is_best, mid_epoch)


def parts(weight: torch.Tensor, step: int) -> dict:
    return {"model": {"w": weight}, "loop": {"epoch": 0, "step": step}}


def test_a_save_returns_before_the_write_and_writes_the_state_as_it_was(tmp_path: Path):
    store, weight = GatedStore(tmp_path), torch.zeros(3)
    store.save(parts(weight, 1), step=1, is_best=False)
    assert store.writing.wait(timeout=30) and not (tmp_path / "last.pt").exists()
    weight += 1  # training goes on while the writer waits
    store.gate.set()
    store.wait()
    saved = torch.load(tmp_path / "last.pt", weights_only=True)
    assert torch.equal(saved["model"]["w"], torch.zeros(3)) and saved["loop"]["step"] == 1


def test_a_failed_write_is_raised_by_the_next_wait(tmp_path: Path):
    store = GatedStore(tmp_path)
    store.failure = OSError(28, "No space left on device")
    store.save(parts(torch.zeros(3), 1), step=1, is_best=False)
    store.gate.set()
    with pytest.raises(OSError, match="No space left"):
        store.wait()
    store.wait()  # raised once


def test_after_a_training_failure_the_write_in_flight_ends_and_its_failure_is_only_logged(tmp_path: Path, caplog):  # noqa: ANN001
    store = GatedStore(tmp_path)
    store.failure = OSError(28, "No space left on device")
    store.save(parts(torch.zeros(3), 1), step=1, is_best=False)
    assert store.writing.wait(timeout=30)
    waited = threading.Thread(target=store.wait_after_failure)
    waited.start()
    waited.join(timeout=0.5)
    assert waited.is_alive()  # it waits for the writer, which still writes
    store.gate.set()
    waited.join(timeout=30)
    assert not waited.is_alive() and not any(t.name == "checkpoint-writer" for t in threading.enumerate())
    assert "the checkpoint being written when training failed was not written: OSError" in caplog.text
    assert caplog.records[-1].levelno == logging.WARNING


def test_a_later_save_copies_into_the_previous_saves_memory_and_writes_its_own_values(tmp_path: Path):
    store, weight = GatedStore(tmp_path), torch.zeros(1024)
    store.gate.set()
    copies = []
    for step in (1, 2, 3):
        weight += 1
        store.save(parts(weight, step), step=step, is_best=False)
        copies.append(store._host_copy["model"]["w"])
        assert store._host_copy["model"]["w"].data_ptr() != weight.data_ptr()  # a copy, never the live tensor
        weight += 100  # training goes on
        store.wait()
        saved = torch.load(tmp_path / "last.pt", weights_only=True)
        assert torch.equal(saved["model"]["w"], torch.full((1024,), 1.0 + 101 * (step - 1)))
        assert saved["loop"]["step"] == step
    assert copies[0].data_ptr() == copies[1].data_ptr() == copies[2].data_ptr()  # one allocation, reused
    grown = torch.ones(2048)  # another shape (a fork that grows its model between saves): new memory
    store.save(parts(grown, 4), step=4, is_best=False)
    store.wait()
    assert store._host_copy["model"]["w"].shape == (2048,)
    assert torch.equal(torch.load(tmp_path / "last.pt", weights_only=True)["model"]["w"], grown)
