"""Writing a checkpoint, as both formats do: atomically and durably, and with one line saying how many bytes it
needs when the disk has no room. A failed write leaves the previous checkpoint as it was and stops every rank."""

from __future__ import annotations

import errno
import resource
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from src.common import files
from src.common.errors import UsageError, no_room_error
from src.parallel import distributed


def save_atomic(payload: dict[str, Any], path: Path) -> None:
    """Write `payload` to `path` durably: a crash mid-write leaves the old file intact."""
    try:
        with files.atomic_file(path) as file:
            torch.save(payload, file)
    except Exception as error:
        raise no_room(error, path, lambda: serialized_size(payload)) or error


def copy_atomic(source: Path, target: Path) -> None:
    try:
        with files.atomic_file(target) as file, open(source, "rb") as original:
            shutil.copyfileobj(original, file)
    except Exception as error:
        raise no_room(error, target, lambda: source.stat().st_size) or error


def serialized_size(payload: dict[str, Any]) -> int:
    """The bytes `torch.save(payload)` writes, counted without keeping them."""
    counter = _ByteCounter()
    torch.save(payload, counter)
    return counter.count


class _ByteCounter:
    count = 0

    def write(self, data: bytes) -> int:
        self.count += len(data)
        return len(data)

    def flush(self) -> None: ...


def _file_size_limit() -> int | None:
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if limit == resource.RLIM_INFINITY else limit


def no_room(error: BaseException, path: Path, size: Callable[[], int]) -> UsageError | None:
    """A one-line error for a write of `path` that found no room (full, quota, file-size limit), else None."""
    if (cause := no_room_error(error)) is None:
        return None
    free, limit = shutil.disk_usage(path.parent).free, _file_size_limit()
    limit_note = "" if limit is None else f", and files may hold at most {limit:,} bytes (ulimit -f)"
    return UsageError(f"cannot write checkpoint {path} ({cause.strerror}): it needs {size():,} bytes, {free:,} are "
                      f"free there{limit_note}; the previous checkpoint is unchanged: make room, then continue with "
                      "resume=auto")


def exceeds_room(needed: int, directory: Path) -> int | None:
    """The errno of writing `needed` bytes into `directory` now (EFBIG, ENOSPC), or None if they fit."""
    if (limit := _file_size_limit()) is not None and needed > limit:
        return errno.EFBIG
    return errno.ENOSPC if needed > shutil.disk_usage(directory).free else None


def stop_every_rank_on_failure(is_main_process: bool, work: Callable[[], None]) -> None:
    """Run `work` on rank 0 and tell every rank whether it could: a failure stops every rank at once. A collective."""
    failure: Exception | None = None
    if is_main_process:
        try:
            work()
        except Exception as error:
            failure = error
    reported = distributed.broadcast_object(None if failure is None else str(failure))
    if failure is not None:
        raise failure
    if reported is not None:
        raise UsageError(reported)  # rank 0 reports it; the others stop quietly (exit code 2)
