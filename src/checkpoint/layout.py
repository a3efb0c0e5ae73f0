"""Where a run's checkpoints live, by name; nothing here reads one.

    checkpoints/
      last.pt  best.pt  step_000000044.pt     one file per checkpoint (dist=ddp)
      step_000000044/  last  best             a directory per checkpoint, and small files naming the newest
                                              and the best (dist=fsdp)

A run that switched dist strategies may hold both; the newer wins."""

from __future__ import annotations

import re
from pathlib import Path

from src.common.errors import UsageError

LAST_FILE, BEST_FILE = "last.pt", "best.pt"
POINTERS = ("last", "best")  # small text files naming a checkpoint directory
STEP = re.compile(r"step_\d{9}(\.pt)?")  # a step checkpoint: file or directory, named by its optimizer step


def step_name(step: int) -> str:
    """`step_000000044`: zero-padded, so names sort by step."""
    return f"step_{step:09d}"


def is_directory_checkpoint(path: Path) -> bool:
    """A checkpoint directory, or a `last` / `best` file naming one."""
    return path.is_dir() or (path.name in POINTERS and path.is_file() and path.stat().st_size < 256)


def resolve(path: Path) -> Path:
    """The directory `path` is or names (a `last` / `best` file); any other path as it is."""
    return path.parent / path.read_text().strip() if path.is_file() and path.name in POINTERS else path


def latest(directory: Path) -> Path | None:
    """`last.pt` or `last`, the later written."""
    return _later(directory / LAST_FILE, directory / "last")


def best(directory: Path) -> Path | None:
    """`best.pt` or `best`, the later written."""
    return _later(directory / BEST_FILE, directory / "best")


def _later(*paths: Path) -> Path | None:
    return max((path for path in paths if path.is_file()), key=lambda path: path.stat().st_mtime_ns, default=None)


def newest_first(directory: Path) -> list[Path]:
    """`last.pt` (or `last`), then the step checkpoints from the highest step down (not `best`: an older state)."""
    steps = [path for path in directory.glob("step_*") if STEP.fullmatch(path.name)]
    steps.sort(key=lambda path: path.name.removesuffix(".pt"), reverse=True)
    newest = latest(directory)
    named = None if newest is None else resolve(newest)  # the directory `last` names
    return [*([] if newest is None else [newest]), *(path for path in steps if path.exists() and path != named)]


def resume_path(directory: Path, resume: str | None) -> Path | None:
    """The checkpoint `resume` (None, `auto` or a path) names; a fresh start refuses a run dir that holds a run."""
    if resume is None:
        if latest(directory) is not None:
            raise UsageError(f"{directory.parent} already holds a run; pass resume=auto to continue it or choose "
                             "another hydra.run.dir")
        return None
    return latest(directory) if resume == "auto" else Path(resume)
