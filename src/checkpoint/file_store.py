"""Checkpoints as one `.pt` file each (dist=ddp): a plain dict of the parts' states, written atomically by rank 0
(every rank holds the same state) and loaded with `weights_only=True`, so opening one never runs code.
`torch.load(path)["models"]["model"]` is the plain module's state_dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import src.checkpoint.layout as layout
from src.checkpoint.store import Checkpoint, Store, read_payload
from src.checkpoint.writing import copy_atomic, save_atomic, stop_every_rank_on_failure
from src.common.errors import UsageError


class FileStore(Store):
    """Writes `last.pt` (every save), `best.pt` (on improvement) and `step_<N>.pt` (mid-epoch saves)."""

    def write(self, payload: dict[str, Any], step: int, is_best: bool, mid_epoch: bool) -> None:
        stop_every_rank_on_failure(self.is_main_process,
                                   lambda: self._write(payload, step if mid_epoch else None, is_best))

    def _write(self, payload: dict[str, Any], step: int | None, is_best: bool) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        last = self.directory / layout.LAST_FILE
        save_atomic(payload, last)
        if is_best:
            copy_atomic(last, self.directory / layout.BEST_FILE)
        if step is not None:
            copy_atomic(last, self.directory / f"{layout.step_name(step)}.pt")
            for old in sorted(self.directory.glob("step_*.pt"))[: -self.keep_last or None]:
                old.unlink()


class FileCheckpoint(Checkpoint):
    """A `.pt` checkpoint: its tensors are read with the rest, onto the CPU."""

    @classmethod
    def read(cls, path: Path) -> "FileCheckpoint":
        if not path.is_file():
            other = path.with_suffix("") if path.suffix == ".pt" else path.with_name(f"{path.name}.pt")
            hint = f"; {other} does (dist=ddp runs write .pt files, dist=fsdp runs folders without .pt)"
            raise UsageError(f"checkpoint {path} does not exist{hint if other.exists() else ''}")
        return cls(path, read_payload(path))
