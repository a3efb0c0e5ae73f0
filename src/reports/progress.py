"""Console progress bars: a tqdm bar when a person watches a terminal, otherwise a stand-in
whose methods do nothing, so the loop calls the same methods either way.

Only the main process draws (several ranks drawing on one console garble each other), and
only when stdout is a terminal: in a log file or a CI log, tqdm's carriage-return redraws
are noise.
"""

from __future__ import annotations

from typing import Iterable, TextIO, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def shows_progress(enabled: bool, is_main_process: bool, stream: TextIO) -> bool:
    """Whether to draw bars: `trainer.progress` is on, this is the main process and `stream` is a terminal."""
    return enabled and is_main_process and stream.isatty()


class NoProgress:
    """What the loop holds when no bar is drawn."""

    def update(self) -> None:
        """One more step done."""

    def show_loss(self, loss: float) -> None:
        """Show `loss` next to the bar (pass a value already on the host: no device sync here)."""

    def close(self) -> None:
        """Take the bar off the console."""


class ProgressBar(NoProgress):
    """A tqdm bar of `total` steps, `done` of them already (say, before a resumed epoch's restart)."""

    def __init__(self, desc: str, total: int, done: int, stream: TextIO) -> None:
        # leave=False: the bar disappears at close, and the epoch's log line takes its place.
        self._bar = tqdm(total=total, initial=done, desc=desc, unit="step", file=stream, leave=False,
                         dynamic_ncols=True)

    def update(self) -> None:
        self._bar.update()

    def show_loss(self, loss: float) -> None:
        # No redraw here: the next update() draws it, within tqdm's rate limit.
        self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def close(self) -> None:
        self._bar.close()


def track(iterable: Iterable[T], desc: str, stream: TextIO) -> Iterable[T]:
    """`iterable`, counted by a bar as it is consumed (closed when it is exhausted)."""
    return tqdm(iterable, desc=desc, unit="batch", file=stream, leave=False, dynamic_ncols=True)
