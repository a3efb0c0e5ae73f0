"""Checkpoints as one store of named parts (src/checkpoint/store.py), in one of two formats:

    dist=ddp    one .pt file per checkpoint        src/checkpoint/file_store.py     FileStore, FileCheckpoint
    dist=fsdp   one directory of shards each      src/checkpoint/sharded_store.py  ShardedStore, ShardedCheckpoint

`open_store` picks the format a run writes, once, from its strategy; `read` picks the reader by the path (a
directory, or the `last` / `best` file naming one, is sharded), so either kind of run resumes, evaluates,
fine-tunes from or exports either kind of checkpoint. The formats import neither each other nor this
module; the chosen one is imported by name here, so the sharded one (DCP and FSDP, ~0.45 s to import) only
when a run or a path needs it: the one deferred import of this package. This module and layout.py import
no torch (the config checks ask layout.py which checkpoints a run dir holds).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from src.checkpoint.layout import is_directory_checkpoint

if TYPE_CHECKING:  # annotations only: store.py imports torch
    from src.checkpoint.store import Checkpoint, Store

STORES = {"ddp": "src.checkpoint.file_store.FileStore", "fsdp": "src.checkpoint.sharded_store.ShardedStore"}
READERS = {False: "src.checkpoint.file_store.FileCheckpoint", True: "src.checkpoint.sharded_store.ShardedCheckpoint"}


def _named(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def open_store(dist: Any, trainer: Any, directory: Path, is_main_process: bool) -> Store:
    """The store a run of `dist.strategy` writes its checkpoints with, into `directory`, keeping
    `trainer.keep_last`; with `trainer.async_checkpoint`, writing in a thread while training goes on, its
    collectives waiting at most `dist.step_timeout_s` (a rank's write apart, which it covers by definition), else
    `dist.timeout_s` (src/checkpoint/store.py)."""
    timeout_s = dist.timeout_s if dist.step_timeout_s is None else dist.step_timeout_s
    return _named(STORES[dist.strategy])(directory, is_main_process, trainer.keep_last, trainer.async_checkpoint,
                                        timeout_s)


def read(path: Path) -> Checkpoint:
    """The checkpoint at `path`, of either format, or one line saying why it is none (missing, truncated,
    foreign, incomplete, a crafted index). Its tensors are read later, into the module that restores them."""
    return _named(READERS[is_directory_checkpoint(path)]).read(path)
