"""Writing files that readers may open at any moment (metrics.json, summaries): never half-written."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomically(path: Path, text: str) -> None:
    """Write `text` to a temp file beside `path`, then rename it over `path` (atomic on POSIX)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
