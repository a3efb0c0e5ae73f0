"""Console progress bars: a tqdm bar on the main process's terminal, elsewhere a disabled one whose methods do
nothing (in a log file, tqdm's carriage-return redraws are noise)."""

from __future__ import annotations

from typing import Iterable, TextIO, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def shows_progress(enabled: bool, is_main_process: bool, stream: TextIO) -> bool:
    return enabled and is_main_process and stream.isatty()


def progress_bar(desc: str, total: int, done: int, stream: TextIO | None) -> tqdm:
    """A bar of `total` steps, `done` of them already, on `stream` (None: disabled); gone when closed."""
    return tqdm(total=total, initial=done, desc=desc, unit="step", file=stream, leave=False, dynamic_ncols=True,
                disable=stream is None)


def track(iterable: Iterable[T], desc: str, stream: TextIO) -> Iterable[T]:
    """`iterable`, counted by a bar as it is consumed (closed when it is exhausted)."""
    return tqdm(iterable, desc=desc, unit="batch", file=stream, leave=False, dynamic_ncols=True)
