"""Checkpoints: a plain dict of state_dicts, written atomically and durably by rank 0, loaded safely.

A checkpoint holds `model` (the unwrapped module's state_dict: no `module.` or
`_orig_mod.` prefixes, loadable without DDP or torch.compile), `optimizer`, `scheduler`,
`scaler`, `epoch` (epochs completed), `step` (optimizer steps taken), `config` (the
run's resolved config), `best` (the best monitored value so far), `history` and
`format`; with trainer.ema.decay set, `ema` (the EMA weights' state_dict, the model's keys);
and `best_weights` ("ema" when trainer.monitor is a val_ema/ metric, else "model": the
weights that made best.pt the best). Files are loaded with `weights_only=True`, so opening one never runs code, and
the config saved in one never chooses code either (src/config/trusted_targets.py).
"""

from __future__ import annotations

import re
import resource
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from src.common import files
from src.common.errors import UsageError
from src.parallel import distributed

FORMAT = "ddp-template-checkpoint/1"
LAST = "last.pt"
BEST = "best.pt"
POINTERS = ("last", "best")  # dist=fsdp: small files naming a checkpoint directory (src/loop/sharded_checkpoint.py)


def is_sharded_path(path: Path) -> bool:
    """A sharded checkpoint directory, or a `last` / `best` file naming one."""
    return path.is_dir() or (path.name in POINTERS and path.is_file() and path.stat().st_size < 256)


def resolve(path: Path) -> Path:
    """The directory `path` is or names (a `last` / `best` file); any other path as it is."""
    if path.is_file() and path.name in POINTERS:
        return path.parent / path.read_text().strip()
    return path


def save_atomic(payload: dict[str, Any], path: Path) -> None:
    """Write `payload` to `path` durably, so that a crash mid-write leaves the old file intact.

    A disk with no room for it (full, over quota, over the file-size limit) is one line
    saying how many bytes the checkpoint needs; the old file is left as it was.
    """
    try:
        with files.atomic_file(path) as file:
            torch.save(payload, file)
    except Exception as error:
        raise no_room(error, path, lambda: serialized_size(payload)) or error


def copy_atomic(source: Path, target: Path) -> None:
    """Copy `source` to `target` durably (best.pt, step_<N>.pt), as `save_atomic` writes."""
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
    """A write-only file that only counts what is written to it."""

    count = 0

    def write(self, data: bytes) -> int:
        self.count += len(data)
        return len(data)

    def flush(self) -> None:
        pass


def no_room(error: BaseException, path: Path, size: Callable[[], int]) -> UsageError | None:
    """A one-line error for a write of `path` that found no room (None for any other failure)."""
    cause = files.no_room_error(error)
    if cause is None:
        return None
    free = shutil.disk_usage(path.parent).free
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    limit_note = "" if limit == resource.RLIM_INFINITY else f", and files may hold at most {limit:,} bytes (ulimit -f)"
    return UsageError(
        f"cannot write checkpoint {path} ({cause.strerror}): it needs {size():,} bytes, {free:,} are free "
        f"there{limit_note}; the previous checkpoint is unchanged: make room, then continue with resume=auto"
    )


def load(path: Path) -> dict[str, Any]:
    """Load a checkpoint of this template onto the CPU, or fail with one clear line. A sharded checkpoint
    (a directory of dist=fsdp, or its `last` / `best` file) gives its non-tensor state; its tensors are
    read into the model later (src/loop/sharded_checkpoint.py)."""
    if is_sharded_path(path):
        # Imported here: torch.distributed.checkpoint (and FSDP with it) costs ~0.45 s, paid by sharded runs only.
        from src.loop import sharded_checkpoint

        return sharded_checkpoint.load(path)
    if not path.is_file():
        raise UsageError(f"checkpoint {path} does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for truncated or foreign files
        reason = type(error).__name__
        raise UsageError(f"checkpoint {path} cannot be read ({reason}): is it a complete .pt file?") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise UsageError(f"{path} is not a checkpoint of this template (no format={FORMAT!r} in it)")
    return payload


def load_model_state(module: torch.nn.Module, state: dict[str, Any], path: Path) -> None:
    """Load a checkpoint's weights into `module`, naming the file when shapes or keys differ."""
    try:
        module.load_state_dict(state)
    except RuntimeError as error:
        # torch names every mismatched key, one kind of problem per line: a few of each say enough.
        problems = [_first_keys(line.strip().rstrip(". ")) for line in str(error).strip().splitlines()[1:]]
        more = f"; and {len(problems) - 2} more" if len(problems) > 2 else ""
        raise UsageError(
            f"checkpoint {path} does not fit this model ({'; '.join(problems[:2])}{more}); "
            "use the model and dataset configs it was saved with"
        ) from None


def _first_keys(problem: str, shown: int = 3) -> str:
    """`Unexpected key(s) in state_dict: "a", "b", ...` cut to its first `shown` keys."""
    keys = re.findall(r'"([^"]+)"', problem)
    if len(keys) <= shown:
        return problem
    return f"{problem.split(':')[0]}: {', '.join(keys[:shown])} and {len(keys) - shown} more"


def stop_every_rank_on_failure(is_main_process: bool, work: Callable[[], None]) -> None:
    """Run `work` on rank 0, then tell every rank whether it could, so a failed write (a full disk) stops
    every rank at once with one line, not rank 0 alone while the others wait for it in their next
    collective. Called on every rank."""
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


class Checkpointer:
    """Writes `checkpoints/last.pt` (every epoch, and at step checkpoints), `best.pt` (on
    improvement) and `step_<N>.pt` (step checkpoints, the newest `keep_last`).

    Only the main process writes; the others hold the same state, so nothing is lost.
    `sharded` (dist=fsdp): every rank writes its shards into `step_<N>/` directories instead, and `last` /
    `best` name them (src/loop/sharded_checkpoint.py). Either kind of run resumes from either kind.
    """

    def __init__(self, directory: Path, is_main_process: bool, keep_last: int = 2, sharded: bool = False) -> None:
        self.directory = directory
        self.is_main_process = is_main_process
        self.keep_last = keep_last
        self.sharded = sharded

    @property
    def last_path(self) -> Path:
        return self.directory / LAST

    @property
    def best_path(self) -> Path:
        return self.directory / BEST

    def save(self, payload: dict[str, Any], is_best: bool, step: int | None = None) -> None:
        """Write `last.pt` (and `best.pt` if `is_best`). A mid-epoch checkpoint (`step` given)
        is also kept as `step_<step>.pt`, the newest `keep_last` of them.

        Called on every rank: rank 0 writes (sharded: every rank writes its shards), and a failure
        stops every rank (`stop_every_rank_on_failure`).
        """
        if self.sharded:
            from src.loop import sharded_checkpoint

            self.directory.mkdir(parents=True, exist_ok=True)
            sharded_checkpoint.write(self.directory, {"format": FORMAT, **payload}, is_best, self.is_main_process,
                                     self.keep_last)
            return
        stop_every_rank_on_failure(self.is_main_process, lambda: self._write(payload, is_best, step))

    def _write(self, payload: dict[str, Any], is_best: bool, step: int | None) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        save_atomic({"format": FORMAT, **payload}, self.last_path)
        if is_best:
            copy_atomic(self.last_path, self.best_path)
        if step is not None:
            copy_atomic(self.last_path, self.directory / f"step_{step:09d}.pt")
            for old in sorted(self.directory.glob("step_*.pt"))[: -self.keep_last or None]:
                old.unlink()

    @property
    def last_pointer(self) -> Path:
        """A sharded run's `last`: the name of its newest complete checkpoint directory."""
        return self.directory / "last"

    def latest(self) -> Path | None:
        """The newest checkpoint: `last.pt` or `last` (the later written, if a run switched dist)."""
        found = [path for path in (self.last_path, self.last_pointer) if path.is_file()]
        return max(found, key=lambda path: path.stat().st_mtime_ns, default=None)

    def newest_first(self) -> list[Path]:
        """The checkpoints holding the newest training state, newest first: `last.pt` (or `last`), then the
        step checkpoints (files and directories) from the highest step down (zero-padded names sort by step)."""
        steps = [path for path in self.directory.glob("step_*") if re.fullmatch(r"step_\d{9}(\.pt)?", path.name)]
        steps.sort(key=lambda path: path.name.removesuffix(".pt"), reverse=True)
        latest = self.latest()
        named = None if latest is None else resolve(latest)  # the directory `last` names
        return [*([] if latest is None else [latest]), *(path for path in steps if path.exists() and path != named)]

    def resume_path(self, resume: str | None) -> Path | None:
        """The checkpoint to resume from: None (fresh start), `auto` or an explicit path.

        A fresh start refuses a run dir that already holds a run, so an old run's
        checkpoints are never overwritten by accident.
        """
        if resume is None:
            if self.latest() is not None:
                raise UsageError(
                    f"{self.directory.parent} already holds a run; pass resume=auto to continue it "
                    "or choose another hydra.run.dir"
                )
            return None
        if resume == "auto":
            return self.latest()
        return Path(resume)
