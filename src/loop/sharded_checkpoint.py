"""Sharded checkpoints (dist.strategy=fsdp): one directory per checkpoint, written by every rank at once
with torch.distributed.checkpoint (DCP), readable on any world size.

    checkpoints/
      step_000000044/     one checkpoint, named by its optimizer step
        __0_0.distcp        rank 0's shards of the model and optimizer tensors (__1_0.distcp: rank 1's, ...)
        .metadata           DCP's index of every shard: written last, by rank 0, once every rank's file is
                            complete (to `.metadata.tmp`, then renamed): the directory is valid only with it
        state.pt            everything that is not a sharded tensor: format, config, scheduler, scaler, the
                            TrainState (epoch, step, history, ...), the optimizer's param_groups (rank 0)
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
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import pickle
import re
import resource
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from src.common import files
from src.common.errors import UsageError
from src.loop.checkpoint import POINTERS, resolve
from src.parallel import distributed

STATE = "state.pt"
METADATA = ".metadata"
STEP_DIR = re.compile(r"step_\d{9}")


def is_complete(directory: Path) -> bool:
    """DCP renames .metadata into place after every rank's shards are written; state.pt comes first."""
    return (directory / METADATA).is_file() and (directory / STATE).is_file()


# -- writing ------------------------------------------------------------------------------------------


def model_and_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The state to save: tensors keyed by parameter name (this rank's shards under FSDP), and the
    optimizer's state by parameter name too, so any world size can read it back."""
    return get_state_dict(module, optimizer)


def write(directory: Path, payload: dict[str, Any], is_best: bool, is_main_process: bool, keep_last: int) -> None:
    """Save `payload` (a Trainer.state_dict with `format`) as `directory/step_<step>/`, then point `last`
    (and `best`) at it. Called on every rank; every rank raises if any part failed."""
    name = f"step_{payload['step']:09d}"
    staging = directory / f"{name}.tmp"
    tensors = {"model": payload["model"], "optimizer": payload["optimizer"]["state"]}
    rest = {**{k: v for k, v in payload.items() if k != "model"},
            "optimizer": {"param_groups": payload["optimizer"]["param_groups"]}}
    _on_main(is_main_process, lambda: _stage(staging, rest))
    try:
        with _alone_is_fine():  # every rank writes its shards; rank 0 renames the index into place last
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(staging, sync_files=True))
    except CheckpointException as error:  # raised on every rank, with every rank's failure
        raise _no_room(error, staging, tensors) or error
    _on_main(is_main_process, lambda: _publish(directory, staging, name, is_best, keep_last))


def _no_room(error: CheckpointException, staging: Path, tensors: dict[str, Any]) -> UsageError | None:
    """One line, as for a .pt (src/loop/checkpoint.py), when a rank's shard file found no room. DCP hands every
    rank the failures of all ranks with their causes stripped (torch.save's zip writer reports EFBIG/ENOSPC as
    "unexpected pos"), so each rank checks its own shard against the free space and the file-size limit, and
    the ranks agree (a collective: every rank calls it)."""
    from src.loop.checkpoint import no_room

    needed = _local_bytes(tensors)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    too_big = needed > shutil.disk_usage(staging.parent).free or (limit != resource.RLIM_INFINITY and needed > limit)
    if not any(distributed.gather_objects(too_big)):
        return None
    cause = OSError(errno.EFBIG if limit != resource.RLIM_INFINITY and needed > limit else errno.ENOSPC, "")
    cause.strerror = os.strerror(cause.errno)
    return no_room(cause, staging, lambda: needed)  # this rank's shard file


def _local_bytes(state: Any) -> int:
    """The bytes of this rank's tensors in a nested state dict (a DTensor's local shard only)."""
    if isinstance(state, dict):
        return sum(_local_bytes(value) for value in state.values())
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0


def _on_main(is_main_process: bool, work: Any) -> None:
    """Run `work` on rank 0 and tell every rank whether it failed (a full disk): all stop together."""
    from src.loop.checkpoint import stop_every_rank_on_failure

    stop_every_rank_on_failure(is_main_process, work)


def _stage(staging: Path, rest: dict[str, Any]) -> None:
    from src.loop.checkpoint import save_atomic

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
    steps = sorted(path for path in directory.iterdir() if path.is_dir() and STEP_DIR.fullmatch(path.name))
    pointed = {resolve(directory / pointer).name for pointer in POINTERS if (directory / pointer).is_file()}
    for path in directory.iterdir():
        stale = path.is_dir() and not STEP_DIR.fullmatch(path.name) and path.name.startswith("step_")
        dropped = path in steps[:-keep_last] and path.name not in pointed
        if stale or dropped:
            shutil.rmtree(path)


# -- reading ------------------------------------------------------------------------------------------


def load(path: Path) -> dict[str, Any]:
    """The non-tensor state of the checkpoint `path` is (or names), with `sharded`: its directory. The
    tensors are read into a model by `restore` or `load_model`."""
    from src.loop import checkpoint

    directory = resolve(path)
    if not directory.is_dir():
        raise UsageError(f"checkpoint {path} names {directory}, which does not exist")
    if not is_complete(directory):
        raise UsageError(f"checkpoint {directory} is incomplete (no {METADATA} or {STATE}: its save did not finish)")
    payload = checkpoint.load(directory / STATE)
    read_metadata(directory)  # refuse a crafted index before anything reads through it
    return {**payload, "sharded": str(directory)}


def restore(module: nn.Module, optimizer: torch.optim.Optimizer, payload: dict[str, Any]) -> None:
    """Load a resumed checkpoint's model (if `initial_model` has not) and optimizer state into this run's
    module and optimizer, whatever wrote it: a sharded directory on any world size (resharded), or a
    `.pt` of dist=ddp into a sharded module (its optimizer state, keyed by position, put to names)."""
    if "sharded" in payload:
        model_state, optimizer_state = get_state_dict(module, optimizer)
        with _alone_is_fine():
            dcp.load({"model": model_state, "optimizer": optimizer_state["state"]},
                     storage_reader=SafeReader(payload["sharded"]))
        optimizer_state["param_groups"] = this_implementation(payload["optimizer"]["param_groups"], optimizer)
        set_state_dict(module, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    else:
        state = by_name(payload["optimizer"], module)
        state["param_groups"] = this_implementation(state["param_groups"], optimizer)
        set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))


IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")  # how to compute a step, not its state


def this_implementation(groups: list[dict[str, Any]], optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Saved param_groups with this run's kernel choices: a dist=ddp checkpoint says fused=true, which sharded
    parameters cannot run (src/loop/optim.py), and a sharded one says fused=None, slower than a ddp run's."""
    return [{**group, **{key: own[key] for key in IMPLEMENTATION if key in own}}
            for group, own in zip(groups, optimizer.param_groups)]


def load_model(module: nn.Module, payload: dict[str, Any]) -> None:
    """Only the model's tensors of a sharded checkpoint, into `module` (plain or sharded)."""
    state = get_model_state_dict(module)
    with _alone_is_fine():
        dcp.load({"model": state}, storage_reader=SafeReader(payload["sharded"]))
    set_model_state_dict(module, state)


def full_model_state(directory: Path) -> dict[str, torch.Tensor]:
    """The whole model's tensors of a sharded checkpoint, read in this one process, with no model to
    build: their names, shapes and dtypes come from the index."""
    metadata = read_metadata(directory)
    state = {key.split(".", 1)[1]: torch.empty(item.size, dtype=item.properties.dtype)
             for key, item in metadata.state_dict_metadata.items() if key.startswith("model.")}
    with _alone_is_fine():
        dcp.load({"model": state}, storage_reader=SafeReader(directory), no_dist=True)
    return state


@contextlib.contextmanager
def _alone_is_fine() -> Iterator[None]:
    """Without a process group (one process: eval.py, export, dist=fsdp on one rank) DCP warns that it assumes
    a single process: it is right, and says so at every save."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def by_name(optimizer_state: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """A torch optimizer state_dict keyed by parameter position (one built over the trainable parameters in
    `module.parameters()` order, as train.py builds it) keyed by parameter name instead."""
    names = [name for name, parameter in module.named_parameters() if parameter.requires_grad]
    groups = [{**group, "params": [names[index] for index in group["params"]]}
              for group in optimizer_state["param_groups"]]
    return {"state": {names[index]: value for index, value in optimizer_state["state"].items()},
            "param_groups": groups}


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
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
