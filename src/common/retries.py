"""Failures a restart cannot fix end the run at once, instead of being retried `--max-restarts` times.

torchrun restarts the whole group after any worker failure; it has no notion of an error that will
recur (a config mistake, a missing dataset folder, a loss that turns NaN at the same step of a
deterministic run, checkpoints that are all unreadable). Such errors are UsageErrors (exit code 2). A
worker that stops on one records the message for its launcher (src/common/errors.py does, as it exits);
a restarted worker of the same launcher finds it where its job starts (`errors.exit_on_usage_error`),
prints it again and exits at once, so no restart trains a step.

The record is a file named after the launcher process (its pid and start time), so it is seen by that
launcher's restarts only, never by another run. Nothing here imports another module of the template.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from src.common.files import write_text_atomically

RECORDS = Path(tempfile.gettempdir()) / "ddp-template-final-failures"


def record_final_failure(message: str) -> None:
    """Under a launcher that would restart this worker, remember that the run failed for good."""
    restarts_left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    path = _record_path()
    if path is None or restarts_left <= 0:
        return
    RECORDS.mkdir(exist_ok=True)
    for stale in RECORDS.glob("*-*"):  # records of launchers that are gone
        pid, started_at = stale.name.split(".")[0].split("-")
        if _process_started_at(int(pid)) != started_at:
            stale.unlink(missing_ok=True)
    write_text_atomically(path, message, shared=True)  # every rank of the group may record at once


def final_failure() -> str | None:
    """In a restarted worker: the message an earlier attempt of this launcher stopped on, if it stopped on a
    usage error (None in a first attempt, or outside a torchrun-style launcher)."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        return None
    path = _record_path()
    if path is None or not path.exists():
        return None
    return path.read_text(encoding="utf-8")


def _record_path() -> Path | None:
    """The record of this worker's launcher (its parent), or None outside a torchrun-style launcher."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    launcher = os.getppid()
    started_at = _process_started_at(launcher)
    return None if started_at is None else RECORDS / f"{launcher}-{started_at}"


def _process_started_at(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (with the pid, unique across reuse),
    or None if it is gone (or this is no Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the command name may hold spaces
