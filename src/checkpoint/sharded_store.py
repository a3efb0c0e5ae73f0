"""Checkpoints as a directory of shards each (dist=fsdp), written by every rank at once with
torch.distributed.checkpoint (DCP) and readable on any world size: `step_<N>/` holds each rank's shard file, DCP's index
(`.metadata`, written last) and state.pt (every part's state, each tensor replaced by its key in the shards). A save
writes `step_<N>.tmp/`, renames it, then rewrites `last` (and `best`) atomically: a process killed at any point leaves
`last` naming a complete directory. A DTensor is written by every rank (its shard), a plain tensor once, so a part whose
tensors differ between ranks must hold DTensors. Loading never runs code: state.pt is read with `weights_only=True`,
only tensors go through DCP, and `.metadata` is read by an unpickler that builds only DCP's metadata classes."""

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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.utils._pytree import tree_leaves, tree_map

import src.checkpoint.layout as layout
from src.checkpoint.store import Checkpoint, Store, read_payload, state_of
from src.checkpoint.writing import exceeds_room, no_room, save_atomic, stop_every_rank_on_failure
from src.common import files
from src.common.errors import UsageError
from src.parallel import distributed

STATE = "state.pt"
METADATA = ".metadata"


class ShardedStore(Store):
    """Writes `step_<N>/` directories of shards (one per save, mid-epoch or not), and `last` / `best` naming them."""

    def snapshot(self, parts: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's tensors by key, and the parts' states with each tensor replaced by its key (state.pt)."""
        tensors: dict[str, torch.Tensor] = {}
        return tensors, _without_tensors(super().snapshot(parts), (), tensors)

    def write(self, snapshot: tuple[dict[str, Any], dict[str, Any]], step: int, is_best: bool, mid_epoch: bool) -> None:
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
            raise _no_room(staging, tensors) or error
        stop_every_rank_on_failure(self.is_main_process,
                                   lambda: _publish(self.directory, staging, name, is_best, self.keep_last))


def _no_room(staging: Path, tensors: dict[str, Any]) -> UsageError | None:
    """One line when a rank's shard found no room: DCP strips the causes ("unexpected pos"), so each rank checks its
    own against the free space and file-size limit, and the ranks agree (a collective)."""
    shards = [tensor.to_local() if hasattr(tensor, "to_local") else tensor for tensor in tensors.values()]
    needed = sum(shard.numel() * shard.element_size() for shard in shards)  # a DTensor's local shard only
    code = exceeds_room(needed, staging.parent)
    if not any(distributed.gather_objects(code is not None)):
        return None
    cause = OSError(code or errno.ENOSPC, os.strerror(code or errno.ENOSPC))
    return no_room(cause, staging, lambda: needed)  # this rank's shard file


_TENSOR = "\0tensor:"  # state.pt's stand-in for a tensor in the shards: this prefix and its key


def _without_tensors(state: Any, path: tuple[str, ...], tensors: dict[str, torch.Tensor]) -> Any:
    """`state` with each tensor moved into `tensors` under the key of its place (`models/model/net.0.weight`)."""
    if isinstance(state, torch.Tensor):
        key = "/".join(path)
        tensors[key] = state
        return _TENSOR + key
    if isinstance(state, dict):
        return {name: _without_tensors(value, (*path, str(name)), tensors) for name, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_without_tensors(value, (*path, str(index)), tensors) for index, value in enumerate(state))
    return state


def _key(value: Any) -> str | None:
    """The key of the tensor `value` stands in for, or None."""
    return value[len(_TENSOR):] if isinstance(value, str) and value.startswith(_TENSOR) else None


def _at(state: Any, key: str) -> Any:
    """The value at `key`'s place (after its part's name) in a part's live state, or None."""
    for name in key.split("/")[1:]:
        if isinstance(state, dict):
            state = state.get(name, state.get(int(name)) if name.isdigit() else None)
        elif isinstance(state, (list, tuple)) and name.isdigit() and int(name) < len(state):
            state = state[int(name)]
        else:
            return None
    return state


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
    # No longer kept: step directories past keep_last that no pointer names, and what killed saves left.
    steps = sorted(path for path in directory.iterdir() if path.is_dir() and layout.STEP.fullmatch(path.name))
    pointed = {layout.resolve(directory / pointer).name for pointer in layout.POINTERS
               if (directory / pointer).is_file()}
    for path in directory.iterdir():
        stale = path.is_dir() and not layout.STEP.fullmatch(path.name) and path.name.startswith("step_")
        if stale or (path in steps[:-keep_last] and path.name not in pointed):
            shutil.rmtree(path)


class ShardedCheckpoint(Checkpoint):
    """A checkpoint directory (or the `last` / `best` file naming it); its tensors are read into the restoring parts."""

    def __init__(self, path: Path, state: dict[str, Any], directory: Path) -> None:
        super().__init__(path, state)
        self.directory = directory

    @classmethod
    def read(cls, path: Path) -> "ShardedCheckpoint":
        if not (directory := layout.resolve(path)).is_dir():
            raise UsageError(f"checkpoint {path} names {directory}, which does not exist")
        if not ((directory / METADATA).is_file() and (directory / STATE).is_file()):
            held = [*layout.newest_first(directory), *layout.newest_first(directory / "checkpoints")]  # a run dir's
            raise UsageError(f"checkpoint {directory} is a folder of checkpoints: name one, e.g. {held[0]}" if held
                             else f"checkpoint {directory} is incomplete (no {METADATA} or {STATE}): its save did not "
                             "finish, or it is no checkpoint")
        state = read_payload(directory / STATE)
        read_metadata(directory)  # refuse a crafted index before anything reads through it
        return cls(path, state, directory)

    def restore_part(self, name: str, part: Any) -> None:
        """Read the part's tensors into those at their places in its live state (each rank its slices), else whole."""
        live = part.load_targets() if hasattr(part, "load_targets") else state_of(part)
        part.load_state_dict(self._read(self.state[name], live, process_group=distributed.collective_group()))

    def whole(self, *keys: str) -> Any:
        return self._read(super().whole(*keys), None, no_dist=True)

    def _read(self, skeleton: Any, live: Any, **where: Any) -> Any:
        """`skeleton` with its tensors read: into those at their places in `live` where the shapes agree, else whole."""
        saved = read_metadata(self.directory).state_dict_metadata
        targets = {}
        for key in filter(None, map(_key, tree_leaves(skeleton))):  # the keys of the tensors it stands in for
            found = _at(live, key)
            fits = isinstance(found, torch.Tensor) and tuple(found.shape) == tuple(saved[key].size)
            targets[key] = found if fits else torch.empty(saved[key].size, dtype=saved[key].properties.dtype)
        if targets:
            with _alone_is_fine():
                dcp.load(targets, storage_reader=SafeReader(self.directory), **where)
        return tree_map(lambda value: value if _key(value) is None else targets[_key(value)], skeleton)


@contextlib.contextmanager
def _alone_is_fine() -> Iterator[None]:
    """Without a process group DCP warns, at every save, that it assumes a single process: it is right."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


_ALLOWED = {  # what DCP's index may build
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "ChunkStorageMetadata",
                                              "MetadataIndex", "TensorProperties", "_MEM_FORMAT_ENCODING",
                                              "StorageMeta"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size", *(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "Path"},
    "pathlib._local": {"PosixPath", "WindowsPath", "Path"},  # where Python 3.13 defines them
    "collections": {"OrderedDict"},
}


class _IndexUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata classes, sizes, dtypes and paths: never a callable the file chooses."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_metadata(directory: Path | str) -> Any:
    try:
        return _IndexUnpickler(io.BytesIO((Path(directory) / METADATA).read_bytes())).load()
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
