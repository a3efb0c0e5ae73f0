"""Errors that are the user's to fix: reported as one line naming what to change, exit code 2."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import re
import resource
import sys
import time
import traceback
from typing import Iterator, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from omegaconf.errors import InterpolationKeyError

from src.common import retries

USAGE_ERROR_EXIT_CODE = 2
NON_MAIN_RANK_GRACE_S = 1.0  # how long other ranks wait, on a usage error, for rank 0 to report it
# How torch's CPU allocator and CUDA's caching allocator say an allocation found no memory.
_NO_MEMORY = ("can't allocate memory", "out of memory")
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a full quota, a file-size limit


class UsageError(CompactHydraException):
    """A mistake in the config, the command line or the files a run needs: printed alone (by Hydra too), exit code 2."""

    reported = False  # True when worker processes have already printed the message
    local = False  # True when one rank alone may find it: that rank prints it


class WorkersReportedUsageError(UsageError):
    """Workers this process started, or a peer rank of this worker, stopped on a UsageError they printed."""

    reported = True


def first_few(names: Sequence[str], shown: int = 4, separator: str = ", ") -> str:
    """The first `shown` of `names`, then "and N more": `a, b and 3 more`, or with separator "; " `a; b; and 3 more`."""
    more = f"{separator.rstrip(' ,')} and {len(names) - shown} more" if len(names) > shown else ""
    return separator.join(names[:shown]) + more


def _chain(error: BaseException | None) -> Iterator[BaseException]:
    """`error` and the errors behind it (Hydra's instantiate wraps what a builder raises)."""
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def find_usage_error(error: BaseException) -> UsageError | None:
    found = next((e for e in _chain(error) if isinstance(e, (UsageError, InterpolationKeyError))), None)
    if isinstance(found, InterpolationKeyError):  # a ${KEY} naming no key of the config: a typo, a YAML without it
        key = re.search(r"key '(([^'.]+)\.[^']+)'", str(found))  # a group's key, e.g. ${task.latent_size}
        chosen = key and HydraConfig.initialized() and HydraConfig.get().runtime.choices.get(key[2])
        fix = (f"{key[2]}={chosen} does not set it: choose a {key[2]} that does, or add +{key[1]}=VALUE" if chosen
               else "set that key in its YAML or with +KEY=VALUE")
        return UsageError(f"{found.full_key or 'the config'}: {str(found).splitlines()[0]}: {fix}")
    return found


def no_room_error(error: BaseException) -> OSError | None:
    """The OSError saying the disk had no room, behind `error` if any (torch.save wraps it in a RuntimeError)."""
    return next((e for e in _chain(error) if isinstance(e, OSError) and e.errno in NO_ROOM), None)


@contextlib.contextmanager
def exit_on_usage_error(is_main_process: bool, in_sweep: bool = False) -> Iterator[None]:
    """Exit with `error: <message>` (printed by the main process) and code 2 if the block raises a UsageError;
    in a sweep the line is printed and raised again. An out-of-memory error propagates with a note."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # by torchrun --max-restarts
    if restarted and (failed_for_good := retries.peer_failure()) is not None:  # an earlier attempt's usage error
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {failed_for_good} (not retried: every restart would stop on it)", file=sys.stderr)
        sys.exit(USAGE_ERROR_EXIT_CODE)
    try:
        yield
    except Exception as error:
        for each in _chain(error) if in_sweep else ():  # Hydra keeps a sweep job's error, not its frames (its model)
            traceback.clear_frames(each.__traceback__)
        if (usage_error := find_usage_error(error)) is None:
            out_of_memory = next((e for e in _chain(error) if isinstance(e, MemoryError) or (
                isinstance(e, RuntimeError) and any(words in str(e) for words in _NO_MEMORY))), None)
            if out_of_memory is None:
                raise
            out_of_memory.add_note(_out_of_memory_hint(out_of_memory))
            raise out_of_memory from None  # torch's error, where it happened (not the wrapper Hydra put around it)
        if (is_main_process or usage_error.local) and not usage_error.reported:
            print(f"error: {usage_error}", file=sys.stderr, flush=True)
        elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # Exiting at once would let torchrun's agent SIGTERM rank 0 before it has printed the line.
            time.sleep(NON_MAIN_RANK_GRACE_S)
        if in_sweep:  # Hydra marks the job failed, runs the others, and ends on the first failure: this line
            raise UsageError(f"error: {usage_error}") from usage_error
        retries.record_final_failure(str(usage_error))  # a restart would stop on it again
        sys.exit(USAGE_ERROR_EXIT_CODE)
    finally:  # a sweep's next job runs in this process: what this one built goes now, not at Python's next full
        if in_sweep:  # garbage collection (its model and optimizer, in reference cycles: memory the next job needs)
            gc.collect()


def _out_of_memory_hint(error: BaseException) -> str:
    """The note under an out-of-memory traceback: the rank, the size asked for, the memory limit, what to change."""
    asked = re.search(r"tried to allocate [\d.,]+ ?\w+", str(error), re.IGNORECASE)  # torch's allocators say
    detail = asked.group(0) if asked else type(error).__name__
    limits = [f"{name} {value / 2**20:,.0f} MiB" for name, value in
              (("address space (ulimit -v)", resource.getrlimit(resource.RLIMIT_AS)[0]),
               ("data (ulimit -d)", resource.getrlimit(resource.RLIMIT_DATA)[0])) if value != resource.RLIM_INFINITY]
    limit = f"limits: {', '.join(limits)}" if limits else "no per-process limit set (the machine's memory is full)"
    return (f"out of memory on rank {os.environ.get('RANK', '0')} ({detail}), {limit}: the model's training "
            "state does not fit one process: under dist=ddp use dist=fsdp, which keeps 1/W of the parameters, "
            "gradients and optimizer state on each of W ranks; under dist=fsdp use more ranks "
            "(torchrun --nproc_per_node=N) or a smaller per-rank batch")
