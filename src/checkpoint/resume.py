"""Which checkpoint a run continues from: chosen once, by rank 0, and the same on every rank.

`resume=auto` (and every restart by torchrun or a requeued SLURM job) takes the newest
training state that loads: `last.pt` (or `last`), else the step checkpoints from the highest step
down (`best` is an older state by design; src/checkpoint/layout.py). Each file skipped is logged
with the reason. So a truncated or empty `last.pt` (a disk that filled up under another tool, a copy
cut short) costs the steps since the newest step checkpoint, not the run; a run whose every
checkpoint is damaged stops with one line. An explicit `resume=PATH` is that file or one error line.

Rank 0 decides and shares its choice; every rank then loads that same file. A rank that cannot
(run dirs on disks the nodes do not share) stops the whole group with one line before any step,
instead of training from other weights than its peers.
"""

from __future__ import annotations

import logging
from pathlib import Path

from src import checkpoint
from src.checkpoint import layout
from src.checkpoint.store import Checkpoint
from src.common.errors import UsageError
from src.parallel.ranks import resume_setting
from src.config import trusted_targets
from src.parallel import distributed

log = logging.getLogger(__name__)


def load_resume_checkpoint(directory: Path, is_main_process: bool, resume: str | None,
                           allowed: set[str]) -> Checkpoint | None:
    """The checkpoint to continue from (None: a fresh start), read on every rank.

    `directory` is the run's checkpoints/; `resume` is None, `auto` or a path (None means `auto` in a restarted run:
    `ranks.resume_setting`); `allowed` are the `_target_`s the saved config may name (src/config/trusted_targets.py).
    Called on every rank at the same point: it runs two collectives.
    """
    resume = resume_setting(resume)
    if resume is None:
        layout.resume_path(directory, None)  # a fresh run refuses a run dir that already holds one
        return None
    choice, failure, chosen = None, None, None
    if is_main_process:
        try:
            choice, chosen = _choose(directory, resume, allowed)
        except UsageError as error:
            failure = str(error)
    choice, failure = distributed.broadcast_object((choice, failure))  # type: ignore[misc]
    if failure is not None:
        raise UsageError(failure)  # rank 0 prints it; the others stop quietly
    if choice is None:
        return None
    path = directory / choice if resume == "auto" else Path(choice)
    if chosen is None:
        chosen, failure = _load_on_this_rank(path, allowed)
    _agree_every_rank_loaded(path, failure)
    return chosen


def _choose(directory: Path, resume: str, allowed: set[str]) -> tuple[str | None, Checkpoint | None]:
    """Rank 0's choice, as every rank will name it (a name inside the checkpoint dir for `auto`,
    since each node resolves it in its own run dir), and the checkpoint read."""
    if resume != "auto":
        return resume, _load_trusted(Path(resume), allowed)
    damaged: list[UsageError] = []
    for path in layout.newest_first(directory):
        try:
            chosen = checkpoint.read(path)
        except UsageError as error:
            log.warning("resume: skipping a damaged checkpoint: %s", error)
            damaged.append(error)
            continue
        trusted_targets.check_saved_config(chosen.config, path, allowed)
        if damaged:
            log.warning("resume: continuing from %s, the newest checkpoint that loads", path)
        return path.name, chosen
    if damaged:
        more = f"; nor does any older one in {directory}" if len(damaged) > 1 else ""
        raise UsageError(f"{damaged[0]}{more}")
    return None, None


def _load_trusted(path: Path, allowed: set[str]) -> Checkpoint:
    chosen = checkpoint.read(path)
    trusted_targets.check_saved_config(chosen.config, path, allowed)
    return chosen


def _load_on_this_rank(path: Path, allowed: set[str]) -> tuple[Checkpoint | None, str | None]:
    """`path` loaded here, or why it could not be."""
    try:
        return _load_trusted(path, allowed), None
    except UsageError as error:
        return None, str(error)


def _agree_every_rank_loaded(path: Path, failure: str | None) -> None:
    """Stop every rank, with one line naming the first rank that failed, unless all loaded `path`."""
    failures = distributed.gather_objects(failure)
    for rank, reason in enumerate(failures):
        if reason is not None:
            raise UsageError(
                f"rank {rank} cannot load {path}, the checkpoint rank 0 resumes from ({reason}); every rank "
                "must see the run dir: put hydra.run.dir on a filesystem all nodes share"
            )
