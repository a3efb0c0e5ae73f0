"""Failures a restart cannot fix end the run at once, not retried `--max-restarts` times: a worker stopping on a
UsageError records it, named after its group (launcher pid and start time, rendezvous id); the group's restarts exit
on it (src/common/errors.py), and its peers and a launcher of its own read it (`peer_failure`): the run's one line."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from src.common.files import write_text_atomically

RECORDS = Path(tempfile.gettempdir()) / "ddp-template-final-failures"


def record_final_failure(message: str) -> None:
    """Under a launcher, remember that the run failed for good (for its restarted workers and this one's peers)."""
    if (path := _record_path()) is None:
        return
    RECORDS.mkdir(exist_ok=True)
    for stale in RECORDS.glob("*-*"):  # records of launchers that are gone
        pid, started_at = stale.name.split(".")[0].split("-")
        if _process_started_at(int(pid)) != started_at:
            stale.unlink(missing_ok=True)
    write_text_atomically(path, message, shared=True)  # every rank of the group may record at once


def peer_failure(launcher: int | None = None, run_id: str | None = None) -> str | None:
    """The usage error a worker of this group stopped on, if any; a launcher names its own (pid and run id)."""
    return path.read_text(encoding="utf-8") if (path := _record_path(launcher, run_id)) and path.exists() else None


def _record_path(launcher: int | None = None, run_id: str | None = None) -> Path | None:
    """The record of this worker's group (the run id tells apart the jobs of a sweep one process launches in turn)."""
    run_id, launcher = run_id or os.environ.get("TORCHELASTIC_RUN_ID"), launcher or os.getppid()
    started_at = None if run_id is None else _process_started_at(launcher)  # None outside a torchrun-style launcher
    return None if started_at is None else RECORDS / f"{launcher}-{started_at}.{run_id.encode().hex()}"


def _process_started_at(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (unique with the pid), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the command name may hold spaces
