"""Hydra meets the launchers: one run dir per run, whatever started the processes.

Hydra resolves `${now:...}` in every process, so torchrun ranks that reach Hydra a
second apart would each create their own timestamped run dir (hydra #2070). Run dirs
are therefore named with `${run_timestamp:FORMAT}`: rank 0's clock, shared with the
other ranks through the launcher's store before Hydra creates any directory. Ranks
other than 0 also skip writing `.hydra/`, so the run dir holds one copy of the config.

Nothing here imports torch unless the run has several processes: `python train.py
--help` and `--cfg job` stay fast.
"""

from __future__ import annotations

import datetime
import os
from typing import Mapping

from omegaconf import OmegaConf

_STORE_KEY = "ddp_template/run_started_at"
_started_at: datetime.datetime | None = None


def run_started_at() -> datetime.datetime:
    """The run's start time: this process's clock alone, or rank 0's in a group."""
    global _started_at
    if _started_at is None:
        _started_at = _agree_on_start_time()
    return _started_at


def _agree_on_start_time() -> datetime.datetime:
    now = datetime.datetime.now()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return now
    from src import distributed

    env = distributed.read_env()
    store = distributed.rendezvous_store(env)
    if env.is_main_process:
        # compare_set keeps the first value: a rank 0 restarted in the same store keeps the dir.
        store.compare_set(_STORE_KEY, "", now.isoformat())
    return datetime.datetime.fromisoformat(store.get(_STORE_KEY).decode())


def register_resolvers() -> None:
    """Make `${run_timestamp:%Y-%m-%d}` available to the config (see conf/config.yaml)."""
    OmegaConf.register_new_resolver(
        "run_timestamp", lambda fmt: run_started_at().strftime(fmt), replace=True
    )


def rank_overrides(environ: Mapping[str, str] = os.environ) -> list[str]:
    """Hydra overrides this rank adds to the command line: ranks other than 0 don't
    write `.hydra/` into the shared run dir."""
    if is_main_rank(environ):
        return []
    return ["hydra.output_subdir=null"]


def is_main_rank(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is rank 0 (or the only process)."""
    return int(environ.get("RANK", "0")) == 0
