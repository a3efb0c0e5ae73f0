"""src/common/files.py: atomic writes, one temp file per writer where several processes write one file."""

from __future__ import annotations

import os
from pathlib import Path

from src.common import files


def test_a_shared_write_goes_through_a_temp_file_of_its_own_process(tmp_path: Path, monkeypatch):
    """Ranks recording the same file at once (src/common/retries.py) never write into one temp file."""
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *args: (opened.append(Path(path)), real_open(path, *args))[1])
    files.write_text_atomically(tmp_path / "record", "first", shared=True)
    files.write_text_atomically(tmp_path / "record", "second")
    assert opened == [tmp_path / f"record.{os.getpid()}.tmp", tmp_path / "record.tmp"]
    assert (tmp_path / "record").read_text() == "second"
    assert [p.name for p in tmp_path.iterdir()] == ["record"]
