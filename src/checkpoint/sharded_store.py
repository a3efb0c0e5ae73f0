"""Checkpoints as a directory of shards each (dist=fsdp): written by every rank at once with
torch.distributed.checkpoint (DCP), readable on any world size.

    checkpoints/
      step_000000044/     one checkpoint, named by its optimizer step
        __0_0.distcp        rank 0's shards of the model and optimizer tensors (__1_0.distcp: rank 1's, ...)
        .metadata           DCP's index of every shard: written last, by rank 0, once every rank's file is
                            complete (to `.metadata.tmp`, then renamed): the directory is valid only with it
        state.pt            every other part (src/checkpoint/store.py): config, scheduler, scaler, loop,
                            callbacks, and the optimizer's param_groups (written by rank 0)
      last                  a small text file naming the newest valid directory ("step_000000044")
      best                  the same, for the best monitored value

A save writes `step_<N>.tmp/` (state.pt first, then DCP's shard files and its .metadata), renames it to
`step_<N>/`, and only then rewrites `last` (and `best`) atomically: a process killed at any point leaves
`last` naming the previous complete directory. `trainer.keep_last` directories stay, and the one `best`
names. Resuming on another world size reads each tensor's pieces into this run's shards (DCP reshards).

Loading never runs code from the file: state.pt is read with `weights_only=True`; DCP itself unpickles
`.metadata` with pickle and would `torch.load(weights_only=False)` any non-tensor value it holds, so no
non-tensor value is written through DCP, and `.metadata` is read with an unpickler that only builds DCP's
own metadata classes (`SafeReader`): a crafted one is one error line, never a call.

Importing this module imports DCP and FSDP (~0.45 s): src/checkpoint/__init__.py does so only for sharded
runs and sharded paths.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from src.checkpoint import layout
from src.checkpoint.store import FORMAT, MODEL, OPTIMIZER, Checkpoint, Store, check_format, state_of
from src.checkpoint.writing import exceeds_room, no_room, save_atomic, stop_every_rank_on_failure
from src.common import files
from src.common.errors import UsageError
from src.parallel import distributed, fsdp

STATE = "state.pt"
METADATA = ".metadata"


def is_complete(directory: Path) -> bool:
    """DCP renames .metadata into place after every rank's shards are written; state.pt comes first."""
    return (directory / METADATA).is_file() and (directory / STATE).is_file()


# -- writing ------------------------------------------------------------------------------------------


class ShardedStore(Store):
    """Writes `step_<N>/` directories of shards, and `last` / `best` naming them."""

    def snapshot(self, parts: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's shards of the model and optimizer tensors by parameter name, so any world size can read
        them back; and every other part, with the optimizer's param_groups, for state.pt."""
        model, optimizer = get_state_dict(parts[MODEL], parts[OPTIMIZER])
        tensors = {MODEL: model, OPTIMIZER: optimizer["state"]}
        rest = {"format": FORMAT, **{name: state_of(part) for name, part in parts.items()
                                     if name not in (MODEL, OPTIMIZER)},
                OPTIMIZER: {"param_groups": optimizer["param_groups"]}}
        return tensors, rest

    def write(self, snapshot: tuple[dict[str, Any], dict[str, Any]], step: int, is_best: bool,
              mid_epoch: bool) -> None:
        """Called on every rank; every rank raises if any part failed. Every save is a directory of its own,
        mid-epoch or not."""
        tensors, rest = snapshot
        self.directory.mkdir(parents=True, exist_ok=True)
        name = layout.step_name(step)
        staging = self.directory / f"{name}.tmp"
        stop_every_rank_on_failure(self.is_main_process, lambda: _stage(staging, rest))
        try:
            with _alone_is_fine():  # every rank writes its shards; rank 0 renames the index into place last
                dcp.save(tensors, storage_writer=dcp.FileSystemWriter(staging, sync_files=True),
                         process_group=distributed.collective_group())
        except CheckpointException as error:  # raised on every rank, with every rank's failure
            raise _no_room(error, staging, tensors) or error
        stop_every_rank_on_failure(self.is_main_process,
                                   lambda: _publish(self.directory, staging, name, is_best, self.keep_last))


def _no_room(error: CheckpointException, staging: Path, tensors: dict[str, Any]) -> UsageError | None:
    """One line, as for a .pt (src/checkpoint/writing.py), when a rank's shard file found no room. DCP hands every
    rank the failures of all ranks with their causes stripped (torch.save's zip writer reports EFBIG/ENOSPC as
    "unexpected pos"), so each rank checks its own shard against the free space and the file-size limit, and
    the ranks agree (a collective: every rank calls it)."""
    needed = _local_bytes(tensors)
    code = exceeds_room(needed, staging.parent)
    if not any(distributed.gather_objects(code is not None)):
        return None
    cause = OSError(code or errno.ENOSPC, os.strerror(code or errno.ENOSPC))
    return no_room(cause, staging, lambda: needed)  # this rank's shard file


def _local_bytes(state: Any) -> int:
    """The bytes of this rank's tensors in a nested state dict (a DTensor's local shard only)."""
    if isinstance(state, dict):
        return sum(_local_bytes(value) for value in state.values())
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0


def _stage(staging: Path, rest: dict[str, Any]) -> None:
    shutil.rmtree(staging, ignore_errors=True)  # a killed save's leftovers
    staging.mkdir(parents=True)
    save_atomic(rest, staging / STATE)


def _publish(directory: Path, staging: Path, name: str, is_best: bool, keep_last: int) -> None:
    """Rename the finished directory into place, then rewrite the pointers; drop what is no longer kept."""
    target, replaced = directory / name, directory / f"{name}.old"
    if target.exists():  # the same step saved again (a stop's checkpoint, then its epoch's end)
        shutil.rmtree(replaced, ignore_errors=True)
        target.rename(replaced)
    staging.rename(target)
    files.fsync_directory(directory)
    files.write_text_atomically(directory / "last", name)
    if is_best:
        files.write_text_atomically(directory / "best", name)
    _prune(directory, keep_last)


def _prune(directory: Path, keep_last: int) -> None:
    steps = sorted(path for path in directory.iterdir() if path.is_dir() and layout.STEP.fullmatch(path.name))
    pointed = {layout.resolve(directory / pointer).name for pointer in layout.POINTERS
               if (directory / pointer).is_file()}
    for path in directory.iterdir():
        stale = path.is_dir() and not layout.STEP.fullmatch(path.name) and path.name.startswith("step_")
        dropped = path in steps[:-keep_last] and path.name not in pointed
        if stale or dropped:
            shutil.rmtree(path)


# -- reading ------------------------------------------------------------------------------------------


class ShardedCheckpoint(Checkpoint):
    """A checkpoint directory (`path` may be the `last` / `best` file naming it): `state` from its state.pt; the
    tensors read from its shards, on any world size, into this run's module and optimizer (sharded or not)."""

    def __init__(self, path: Path, state: dict[str, Any], directory: Path) -> None:
        super().__init__(path, state)
        self.directory = directory

    @classmethod
    def read(cls, path: Path) -> "ShardedCheckpoint":
        """The checkpoint `path` is (or names), or one line saying why it cannot be read."""
        directory = layout.resolve(path)
        if not directory.is_dir():
            raise UsageError(f"checkpoint {path} names {directory}, which does not exist")
        if not is_complete(directory):
            raise UsageError(f"checkpoint {directory} is incomplete (no {METADATA} or {STATE}: its save did not "
                             "finish)")
        try:
            payload = torch.load(directory / STATE, map_location="cpu", weights_only=True)
        except Exception as error:  # a truncated or foreign state.pt
            raise UsageError(f"checkpoint {directory / STATE} cannot be read ({type(error).__name__}): is it a "
                             "complete .pt file?") from None
        state = check_format(payload, directory / STATE)
        read_metadata(directory)  # refuse a crafted index before anything reads through it
        return cls(path, state, directory)

    def _load_model(self, module: nn.Module) -> None:
        state = get_model_state_dict(module)
        with _alone_is_fine():
            dcp.load({MODEL: state}, storage_reader=SafeReader(self.directory))
        set_model_state_dict(module, state)

    def load_optimizer(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's state, resharded into this run's (a plain module's optimizer takes it whole)."""
        state = get_optimizer_state_dict(module, optimizer)
        with _alone_is_fine():
            dcp.load({OPTIMIZER: state["state"]}, storage_reader=SafeReader(self.directory))
        state["param_groups"] = fsdp.this_implementation(self.state[OPTIMIZER]["param_groups"], optimizer)
        set_optimizer_state_dict(module, optimizer, state)

    def model_weights(self) -> dict[str, torch.Tensor]:
        """The whole model's tensors, read in this one process: their names, shapes and dtypes come from the
        index."""
        metadata = read_metadata(self.directory)
        state = {key.split(".", 1)[1]: torch.empty(item.size, dtype=item.properties.dtype)
                 for key, item in metadata.state_dict_metadata.items() if key.startswith(f"{MODEL}.")}
        with _alone_is_fine():
            dcp.load({MODEL: state}, storage_reader=SafeReader(self.directory), no_dist=True)
        return state


@contextlib.contextmanager
def _alone_is_fine() -> Iterator[None]:
    """Without a process group (one process: eval.py, export, dist=fsdp on one rank) DCP warns that it assumes
    a single process: it is right, and says so at every save."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# -- the index, read safely -----------------------------------------------------------------------------

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "ChunkStorageMetadata",
                                              "MetadataIndex", "TensorProperties", "_MEM_FORMAT_ENCODING",
                                              "StorageMeta"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size", *(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _IndexUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata classes, sizes, dtypes and paths: never a callable the file chooses."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_metadata(directory: Path | str) -> Any:
    path = Path(directory) / METADATA
    try:
        return _IndexUnpickler(io.BytesIO(path.read_bytes())).load()
    except Exception as error:  # a truncated, foreign or crafted index
        raise UsageError(f"checkpoint {directory} has an index ({METADATA}) that is not DCP's metadata "
                         f"({type(error).__name__}: {error}); it was not loaded") from None


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, with the index read by `read_metadata` instead of `pickle.load`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
