"""logger=csv: every scalar the run reports as a `step,name,value` row of one CSV file in the run dir, the
hyperparameters first (no step, names `param/<key>`). A continued run appends, dropping a row a kill cut short."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping
from typing import Any, TextIO

from src.reports.trackers import RunIdentity, Tracker

HEADER = "step,name,value\n"


class CSVTracker(Tracker):
    def __init__(self, filename: str = "scalars.csv") -> None:
        self.filename = filename
        self._file: TextIO | None = None
        self._sent: dict[str, int] = {}

    def open(self, run_id: str | None, identity: RunIdentity, params: Mapping[str, Any]) -> str | None:
        path = identity.run_dir / self.filename
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        held = text[: text.rfind("\n") + 1] if text.startswith(HEADER) else ""  # up to its last complete row
        self._sent = {}  # the last step of each name held (the hyperparameters' rows, without a step: -1)
        for row in csv.DictReader(io.StringIO(held)):
            self._sent[row["name"]] = max(int(row["step"]) if row["step"] else -1, self._sent.get(row["name"], -1))
        if held:  # what a kill cut short goes; the rest stays
            os.truncate(path, len(held.encode("utf-8")))
        self._file = path.open("a" if held else "w", encoding="utf-8", newline="")
        if not held:
            self._file.write(HEADER)
            self._write([("", f"param/{key}", value) for key, value in params.items()])
        return None

    def sent_steps(self) -> dict[str, int]:
        return dict(self._sent)

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self._write([(step, name, value) for name, value in scalars.items()])

    def _write(self, rows: list[tuple[Any, str, Any]]) -> None:
        assert self._file is not None, "log() before open()"
        csv.writer(self._file, lineterminator="\n").writerows(rows)
        self._file.flush()

    def close(self, status: str, stop_reason: str | None) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
