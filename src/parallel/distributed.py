"""This process's device, backend and process group, its model's data-parallel wrapper, and the few collectives the
template needs; a process no launcher started runs as a group of one without a process group."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import itertools
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from src.common.errors import UsageError
from src.common.files import write_text_atomically
from src.parallel import fsdp, hang
from src.parallel.ranks import PORT_FILE, DistEnv, read_env
from src.parallel.sync_batchnorm import convert_sync_batchnorm


def select_device(requested: str, env: DistEnv) -> torch.device:
    """`auto` takes this rank's GPU (cuda:LOCAL_RANK) when there is one, else the CPU."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("trainer.device=cuda but no CUDA GPU is visible; use trainer.device=cpu or auto")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    if env.local_rank >= torch.cuda.device_count():
        raise UsageError(f"LOCAL_RANK={env.local_rank} but only {torch.cuda.device_count()} GPUs are visible; "
                         "start at most one process per GPU (--nproc_per_node)")
    return torch.device("cuda", env.local_rank)


def select_backend(requested: str, device: torch.device) -> str:
    """`auto` is nccl for GPUs and gloo for the CPU; nccl cannot move CPU tensors."""
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise UsageError("dist.backend=nccl needs CUDA devices; use dist.backend=gloo (or auto) on the CPU")
    return requested


@dataclass(frozen=True)
class Runtime:
    """Everything the rest of the run needs to know about the process group."""

    env: DistEnv
    device: torch.device
    backend: str | None  # None when running as a single process
    # What the loop calls once its first training step is done: collectives wait dist.step_timeout_s from then on.
    first_step_taken: Callable[[], None] = lambda: None

    @property
    def is_main_process(self) -> bool:
        return self.env.is_main_process

    @property
    def world_size(self) -> int:
        return self.env.world_size


_groups_started = 0


@contextlib.contextmanager
def process_group(requested_device: str, requested_backend: str, timeout_s: float,
                  step_timeout_s: float | None = None) -> Iterator[Runtime]:
    """Join the launcher's process group for the block, then leave it, even on failure; collectives wait `timeout_s`
    until the first training step, then `step_timeout_s`, and a timeout names the ranks that did not arrive."""
    global _groups_started
    env = read_env()
    device = select_device(requested_device, env)
    backend = select_backend(requested_backend, device)  # nccl on a CPU is a mistake whatever the world size
    if not env.is_distributed:
        yield Runtime(env, device, backend=None)
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # The rendezvous store, under fresh keys for each group (a sweep's, a restart's): old keys wedge a rendezvous.
    _groups_started += 1
    agent_serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if agent_serves else "0"
    store = dist.PrefixStore(f"ddp_template/restart{restart}/group{_groups_started}", rendezvous_store(env))
    dist.init_process_group(backend=backend, store=store, rank=env.rank, world_size=env.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)
    try:
        with hang.diagnosed(store, env.rank, env.world_size, timeout_s, step_timeout_s) as tighten:
            yield Runtime(env, device, backend, tighten)
    finally:
        dist.destroy_process_group()


def exit_after_a_group(status: int = 0) -> None:
    """End this process now if it ran a process group: atexit handlers run, the interpreter's teardown does not (a
    gloo worker thread DDP keeps alive may free tensors during it and abort the process: pytorch/pytorch#179291)."""
    if _groups_started == 0:
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)


def prepare_model(module: torch.nn.Module, runtime: Runtime, sync_bn: bool, find_unused_parameters: bool,
                  sharding: Any = None, param_dtype: torch.dtype | None = None,
                  initialise: Callable[[torch.nn.Module], None] = lambda module: None
                  ) -> tuple[torch.nn.Module, torch.nn.Module]:
    """`(module, train_model)`: `module` on this rank's device (sharded with `sharding`, materialised from meta and
    given its values by `initialise`), and what the loop trains: DDP's wrapper, or the module itself."""
    if runtime.env.is_distributed and sync_bn:
        module = convert_sync_batchnorm(module, runtime.device)
    on_meta = any(tensor.is_meta for tensor in itertools.chain(module.parameters(), module.buffers()))
    if sharding is not None and runtime.env.is_distributed:
        if sharding.cpu_offload and runtime.device.type != "cuda":  # FSDP2 pins host memory for the copies
            raise UsageError("dist.fsdp.cpu_offload=true moves the shards between host memory and a GPU; this run "
                             "is on the CPU, where they already are: leave it false")
        module = fsdp.shard(module if on_meta else module.to(runtime.device), sharding.wrap,
                            sharding.reshard_after_forward, sharding.cpu_offload, param_dtype, sharding.min_unit_params)
        if on_meta:
            module.to_empty(device=runtime.device)
    else:
        module = fsdp.to_empty(module, runtime.device) if on_meta else module.to(runtime.device)
    initialise(module)
    if sharding is not None or not runtime.env.is_distributed:  # sharded, or one process: no wrapper
        return module, module
    return module, torch.nn.parallel.DistributedDataParallel(
        module, device_ids=[runtime.device.index] if runtime.device.type == "cuda" else None,
        find_unused_parameters=find_unused_parameters)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _all_reduce(tensor: torch.Tensor, op: Any) -> torch.Tensor:
    """The elementwise `op` of `tensor` over all ranks, in place and returned (a no-op in a single process)."""
    if is_initialized():
        dist.all_reduce(tensor, op=op)
    return tensor


all_reduce_sum = functools.partial(_all_reduce, op=dist.ReduceOp.SUM)
all_reduce_min = functools.partial(_all_reduce, op=dist.ReduceOp.MIN)
all_reduce_max = functools.partial(_all_reduce, op=dist.ReduceOp.MAX)


def broadcast_object(obj: object, src: int = 0) -> object:
    """Rank `src`'s `obj` on every rank (identity in a single process)."""
    if not is_initialized():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=collective_group())
    return holder[0]


def gather_objects(obj: object) -> list[object]:
    """Every rank's `obj`, in rank order, on every rank (`[obj]` in a single process)."""
    if not is_initialized():
        return [obj]
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj, group=collective_group())
    return gathered


_this_thread = threading.local()  # the group the object collectives above use in this thread (None: the default)


def new_group(timeout_s: float | None) -> Any:
    """A second gloo group, for a thread whose collectives run beside the training thread's (None in one process)."""
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    return dist.new_group(backend="gloo", timeout=timeout) if is_initialized() else None


def collective_group() -> Any:
    return getattr(_this_thread, "group", None)


@contextlib.contextmanager
def collectives_on(group: Any) -> Iterator[None]:
    """This thread's `broadcast_object` and `gather_objects` (and what asks `collective_group()`) use `group`."""
    _this_thread.group = group
    try:
        yield
    finally:
        _this_thread.group = None


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """Rank 0 runs the block before the others (say, a download), so they find its files."""
    is_waiting_rank = is_initialized() and dist.get_rank() != 0
    if is_waiting_rank:
        dist.barrier()
    try:
        yield
    finally:
        # Also when rank 0's block fails: the others then run it and stop on the same error, not die at this barrier.
        if is_initialized() and not is_waiting_rank:
            dist.barrier()


_store: dist.Store | None = None


def _release_store() -> None:
    """Close the store while the interpreter is still whole, not during its teardown."""
    global _store
    _store = None


def rendezvous_store(env: DistEnv, timeout_s: float = 600.0) -> dist.Store:
    """The group's key-value store, before the process group: torchrun's agent's, or one rank 0 hosts."""
    global _store
    if _store is not None:
        return _store
    atexit.register(_release_store)
    agent_serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if PORT_FILE in os.environ and not agent_serves:
        _store = _published_store(env, Path(os.environ[PORT_FILE]), timeout_s)
    else:
        _store = dist.TCPStore(host_name=env.master_addr, port=env.master_port, world_size=env.world_size,
                               is_master=env.is_main_process and not agent_serves,
                               timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    return _store


_TOKEN_KEY = "ddp_template/port_file_token"


def _published_store(env: DistEnv, port_file: Path, timeout_s: float) -> dist.Store:
    """A submitit job's store: rank 0 hosts it on a port the OS picks and writes that port and a token into the job
    folder every node shares. submitit's port, drawn from the job id, may be busy on the node (rank 0 would fail, the
    others wait out the timeout); the token tells an earlier start's file (a requeue's) from this one's."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if env.is_main_process:
        store = dist.TCPStore(env.master_addr, 0, env.world_size, True, timeout=timeout, wait_for_workers=False)
        store.set(_TOKEN_KEY, token := uuid.uuid4().hex)
        write_text_atomically(port_file, f"{store.port} {token}", shared=True)
        return store
    deadline, last_error = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            port, token = port_file.read_text().split()
            store = dist.TCPStore(env.master_addr, int(port), env.world_size, False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=min(2.0, timeout_s)))
            if store.get(_TOKEN_KEY).decode() == token:
                store.set_timeout(timeout)
                return store
        except (OSError, ValueError, RuntimeError) as error:  # not written yet, or an earlier start's port
            last_error = error
        time.sleep(0.1)
    message = f"rank {env.rank}: no store of rank 0's at the port in {port_file} within {timeout_s:g} s"
    raise TimeoutError(message) from last_error
