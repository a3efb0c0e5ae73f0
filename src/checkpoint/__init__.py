"""Checkpoints as one store of named parts (store.py), in one of two formats: one `.pt` file per checkpoint
(dist=ddp, file_store.py) or one directory of shards each (dist=fsdp, sharded_store.py). `open_store` picks the
format a run writes by its strategy; `read` picks the reader by the path, so either kind of run resumes,
evaluates, fine-tunes from or exports either kind of checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from src.checkpoint.file_store import FileCheckpoint, FileStore
from src.checkpoint.layout import is_directory_checkpoint
from src.checkpoint.sharded_store import ShardedCheckpoint, ShardedStore
from src.checkpoint.store import Checkpoint, Store

STORES = {"ddp": FileStore, "fsdp": ShardedStore}


def open_store(dist: Any, trainer: Any, directory: Path, is_main_process: bool) -> Store:
    """The store a run of `dist.strategy` writes into `directory` (its background writes' collectives waiting
    `dist.step_timeout_s`, else `dist.timeout_s`)."""
    timeout_s = dist.timeout_s if dist.step_timeout_s is None else dist.step_timeout_s
    return STORES[dist.strategy](directory, is_main_process, trainer.keep_last, trainer.async_checkpoint, timeout_s)


def read(path: Path) -> Checkpoint:
    """The checkpoint at `path`, of either format, or one line saying why it is none."""
    return (ShardedCheckpoint if is_directory_checkpoint(path) else FileCheckpoint).read(path)
