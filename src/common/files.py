"""Files that readers may open at any moment (checkpoints, metrics.json, summaries): written to a temp file,
fsync'ed and renamed over the target, so after a crash the target holds the old bytes or the new ones; a failed
write (a full disk) removes its temp file."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import BinaryIO, Iterator


@contextlib.contextmanager
def atomic_file(path: Path, shared: bool = False) -> Iterator[BinaryIO]:
    """A binary file whose content replaces `path` when the block ends. `shared`: other processes may write `path`
    at the same time (a temp file per pid; the last rename wins)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp" if shared else f"{path.name}.tmp")
    try:
        with open(tmp, "wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())  # the bytes on disk before the rename makes them `path`
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)  # the rename itself on disk


def fsync_directory(directory: Path) -> None:
    """Make the directory's entries (a rename into it) durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_text_atomically(path: Path, text: str, shared: bool = False) -> None:
    with atomic_file(path, shared) as file:
        file.write(text.encode("utf-8"))
