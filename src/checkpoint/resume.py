"""Which checkpoint a run continues from: chosen once, by rank 0, and loaded by every rank. `resume=auto` takes the
newest training state that loads (`last.pt` or `last`, else the step checkpoints from the highest step down, each
one skipped logged with why); a run whose every checkpoint is damaged, or a rank that cannot load rank 0's choice
(run dirs on disks the nodes do not share), stops the whole group with one line before any step."""

from __future__ import annotations

import logging
from pathlib import Path

from src import checkpoint
from src.checkpoint import layout
from src.checkpoint.store import Checkpoint
from src.checkpoint.trained import read_trusted
from src.common.errors import UsageError
from src.config import trusted_targets
from src.parallel import distributed
from src.parallel.ranks import resume_setting

log = logging.getLogger(__name__)


def load_resume_checkpoint(directory: Path, is_main_process: bool, resume: str | None,
                           allowed: set[str]) -> Checkpoint | None:
    """The checkpoint to continue from (None: a fresh start), read on every rank: `resume` is None, `auto` or a path
    in `directory`, the run's checkpoints/; `allowed`: the `_target_`s its config may name. Two collectives."""
    if (resume := resume_setting(resume)) is None:
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
        try:
            chosen = read_trusted(path, allowed)
        except UsageError as error:
            failure = str(error)
    for rank, reason in enumerate(distributed.gather_objects(failure)):
        if reason is not None:
            raise UsageError(f"rank {rank} cannot load {path}, the checkpoint rank 0 resumes from ({reason}); every "
                             "rank must see the run dir: put hydra.run.dir on a filesystem all nodes share")
    return chosen


def _choose(directory: Path, resume: str, allowed: set[str]) -> tuple[str | None, Checkpoint | None]:
    """Rank 0's choice as every rank names it (`auto`: a name each node resolves in its run dir), and it read."""
    if resume != "auto":
        return resume, read_trusted(Path(resume), allowed)
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
