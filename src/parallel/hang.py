"""A rank that stops arriving (frozen, hung, swapped out): fail the group soon, and name it (docs/fault-tolerance.md).
After the first training step the group's timeout drops from `dist.timeout_s` (start-up) to `dist.step_timeout_s`, the
longest gap between two collectives of a running job. gloo says only "Timed out waiting 10000ms for recv", so every rank
that timed out marks itself in the launcher's store and, after a short grace, the unmarked ranks are named; those on
this host are SIGKILLed as this process exits (a stopped process never exits; some launchers wait for every task)."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import re
import signal
import socket
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator

import torch.distributed as dist

log = logging.getLogger(__name__)

CENSUS_GRACE_S = 3.0  # how long ranks that timed out wait for each other's marks
_REPO = Path(__file__).resolve().parents[2]
_DDP_FILE = str(Path("torch", "nn", "parallel", "distributed.py"))
# gloo's words for a collective that waited too long (and for the next call on the closed connection), nccl's.
_TIMEOUT = re.compile(r"Timed out waiting \d+ms|Application timeout caused pair closure|collective operation timeout")
_PEER_GAVE_UP = re.compile(r"closed by peer|connection reset|pair closure", re.IGNORECASE)


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than the group's timeout for ranks that did not arrive."""


@contextlib.contextmanager
def diagnosed(store: dist.Store, rank: int, world_size: int, timeout_s: float,
              step_timeout_s: float | None) -> Iterator[Callable[[], None]]:
    """Around a process group's life: give what tightens its timeout, and name the ranks a timeout waited for."""
    store.set(f"process/{rank}", f"{socket.gethostname()} {os.getpid()}")  # whom to end if it freezes
    key, seconds = "dist.timeout_s", timeout_s  # the group's timeout now, and the setting it comes from

    def tighten() -> None:
        nonlocal key, seconds
        if step_timeout_s is not None and key != "dist.step_timeout_s":
            dist.set_timeout(datetime.timedelta(seconds=step_timeout_s))
            key, seconds = "dist.step_timeout_s", step_timeout_s

    try:
        yield tighten
    except RuntimeError as error:
        if _PEER_GAVE_UP.search(str(error)):  # a peer timed out first: this rank is no frozen one
            _mark_alive(store, rank)
        if not _TIMEOUT.search(str(error)):
            raise
        missing = _ranks_that_did_not_arrive(store, rank, world_size)
        ranks = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
        who = (f"{ranks} did not arrive (stopped, hung, or far slower than the others)"
               f"{_end_frozen_peers(store, missing)}" if missing else "every rank was waiting (a network fault?)")
        message = f"{_collective(error)} timed out after {seconds:g} s ({key}): {who}"
        log.error(message)
        raise CollectiveTimeout(message) from error


def _mark_alive(store: dist.Store, rank: int) -> None:
    store.set_timeout(datetime.timedelta(seconds=CENSUS_GRACE_S))  # the store's host may be the frozen rank
    with contextlib.suppress(RuntimeError):
        store.set(f"alive_after_fault/{rank}", "1")


def _ranks_that_did_not_arrive(store: dist.Store, rank: int, world_size: int) -> list[int]:
    """Mark this rank alive; the ranks that have not marked themselves within the grace."""
    _mark_alive(store, rank)
    deadline = time.monotonic() + CENSUS_GRACE_S
    try:
        while True:
            missing = [r for r in range(world_size) if not store.check([f"alive_after_fault/{r}"])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)
    except RuntimeError:  # the store is unreachable: its host is among those that did not arrive
        return [r for r in range(world_size) if r != rank]


def _end_frozen_peers(store: dist.Store, missing: list[int]) -> str:
    """SIGKILL the missing ranks on this host once this process exits (after its error); says which."""
    peers = []
    for rank in missing:
        with contextlib.suppress(RuntimeError, ValueError):
            host, pid = store.get(f"process/{rank}").decode().split()
            if host == socket.gethostname():
                peers.append((rank, int(pid)))
    if not peers:
        return ""
    atexit.register(_kill, [pid for _, pid in peers])
    return f"; ending {', '.join(f'rank {rank} (pid {pid})' for rank, pid in peers)} on this host"


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _collective(error: BaseException) -> str:
    """Which collective timed out, and the line of this project that ran it, from the traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    machinery = (Path(__file__).resolve(), Path(__file__).with_name("distributed.py"))
    ours = [f for f in frames if (path := Path(f.filename).resolve()).is_relative_to(_REPO)
            and "site-packages" not in path.parts and path not in machinery]
    last = ours[-1] if ours else None
    where = f" ({Path(last.filename).resolve().relative_to(_REPO)}:{last.lineno} {last.name})" if last else ""
    api = [f.name for f in frames if f.filename.endswith("distributed_c10d.py") and not f.name.startswith("_")]
    ddp = [f.name for f in frames if f.filename.endswith(_DDP_FILE)]
    if api:
        return f"torch.distributed.{api[0]}{where}"
    if ddp and ddp[-1] != "forward":
        return f"DistributedDataParallel.{ddp[-1]}{where}"
    if any(f.name == "backward" for f in frames):
        return f"DDP's gradient all-reduce in backward(){where}"
    return f"a collective{where}"
