"""Checkpoints: a plain dict of state_dicts, written atomically by rank 0, loaded safely.

A checkpoint holds `model` (the unwrapped module's state_dict: no `module.` or
`_orig_mod.` prefixes, loadable without DDP or torch.compile), `optimizer`, `scheduler`,
`scaler`, `epoch` (epochs completed), `step` (optimizer steps taken), `config` (the
run's resolved config), `best` (the best monitored value so far), `history` and
`format`. Files are loaded with `weights_only=True`, so opening one never runs code.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from src.errors import UsageError

FORMAT = "ddp-template-checkpoint/1"
LAST = "last.pt"
BEST = "best.pt"


def save_atomic(payload: dict[str, Any], path: Path) -> None:
    """Write `payload` to `path` so that a crash mid-write leaves the old file intact."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load(path: Path) -> dict[str, Any]:
    """Load a checkpoint of this template onto the CPU, or fail with one clear line."""
    if not path.is_file():
        raise UsageError(f"checkpoint {path} does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for truncated or foreign files
        reason = type(error).__name__
        raise UsageError(f"checkpoint {path} cannot be read ({reason}): is it a complete .pt file?") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise UsageError(f"{path} is not a checkpoint of this template (no format={FORMAT!r} in it)")
    return payload


def load_model_state(module: torch.nn.Module, state: dict[str, Any], path: Path) -> None:
    """Load a checkpoint's weights into `module`, naming the file when shapes or keys differ."""
    try:
        module.load_state_dict(state)
    except RuntimeError as error:
        # torch names every mismatched key, one kind of problem per line: a few of each say enough.
        problems = [_first_keys(line.strip().rstrip(". ")) for line in str(error).strip().splitlines()[1:]]
        more = f"; and {len(problems) - 2} more" if len(problems) > 2 else ""
        raise UsageError(
            f"checkpoint {path} does not fit this model ({'; '.join(problems[:2])}{more}); "
            "use the model and dataset configs it was saved with"
        ) from None


def _first_keys(problem: str, shown: int = 3) -> str:
    """`Unexpected key(s) in state_dict: "a", "b", ...` cut to its first `shown` keys."""
    keys = re.findall(r'"([^"]+)"', problem)
    if len(keys) <= shown:
        return problem
    return f"{problem.split(':')[0]}: {', '.join(keys[:shown])} and {len(keys) - shown} more"


class Checkpointer:
    """Writes `checkpoints/last.pt` (every epoch, and at step checkpoints), `best.pt` (on
    improvement) and `step_<N>.pt` (step checkpoints, the newest `keep_last`).

    Only the main process writes; the others hold the same state, so nothing is lost.
    """

    def __init__(self, directory: Path, is_main_process: bool, keep_last: int = 2) -> None:
        self.directory = directory
        self.is_main_process = is_main_process
        self.keep_last = keep_last

    @property
    def last_path(self) -> Path:
        return self.directory / LAST

    @property
    def best_path(self) -> Path:
        return self.directory / BEST

    def save(self, payload: dict[str, Any], is_best: bool, step: int | None = None) -> None:
        """Write `last.pt` (and `best.pt` if `is_best`). A mid-epoch checkpoint (`step` given)
        is also kept as `step_<step>.pt`, the newest `keep_last` of them."""
        if not self.is_main_process:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        save_atomic({"format": FORMAT, **payload}, self.last_path)
        if is_best:
            self._copy_atomic(self.last_path, self.best_path)
        if step is not None:
            self._copy_atomic(self.last_path, self.directory / f"step_{step:09d}.pt")
            for old in sorted(self.directory.glob("step_*.pt"))[: -self.keep_last or None]:
                old.unlink()

    @staticmethod
    def _copy_atomic(source: Path, target: Path) -> None:
        tmp = target.with_name(target.name + ".tmp")
        shutil.copyfile(source, tmp)
        os.replace(tmp, target)

    def resume_path(self, resume: str | None) -> Path | None:
        """The checkpoint to resume from: None (fresh start), `auto` or an explicit path.

        A fresh start refuses a run dir that already holds a run, so an old run's
        checkpoints are never overwritten by accident.
        """
        if resume is None:
            if self.last_path.exists():
                raise UsageError(
                    f"{self.directory.parent} already holds a run; pass resume=auto to continue it "
                    "or choose another hydra.run.dir"
                )
            return None
        if resume == "auto":
            return self.last_path if self.last_path.exists() else None
        return Path(resume)
