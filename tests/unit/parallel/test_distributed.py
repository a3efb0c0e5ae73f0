"""src/parallel/distributed.py on one process: reading the launcher's environment, device and backend
choice, and the single-process paths of the collectives (the multi-process paths run in the
CLI tests)."""

import os
import subprocess
import sys

import pytest
import torch

from src.common.errors import UsageError
from src.parallel import distributed


def test_no_launcher_variables_means_a_single_process():
    env = distributed.read_env({})
    assert (env.rank, env.local_rank, env.world_size, env.is_distributed, env.is_main_process) == (0, 0, 1, False, True)


def test_torchrun_variables_are_read():
    env = distributed.read_env({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
                                "MASTER_ADDR": "node3", "MASTER_PORT": "1234"})
    assert (env.rank, env.local_rank, env.world_size, env.master_addr, env.master_port) == (5, 1, 8, "node3", 1234)
    assert env.is_distributed and not env.is_main_process


def test_auto_device_is_the_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.select_device("auto", distributed.DistEnv()) == torch.device("cpu")
    with pytest.raises(UsageError, match="trainer.device=cuda but no CUDA GPU is visible"):
        distributed.select_device("cuda", distributed.DistEnv())


def test_auto_device_is_this_ranks_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert distributed.select_device("auto", distributed.DistEnv(rank=11, local_rank=3, world_size=16)) == \
        torch.device("cuda", 3)
    assert distributed.select_device("cpu", distributed.DistEnv()) == torch.device("cpu")
    with pytest.raises(UsageError, match="LOCAL_RANK=8 but only 8 GPUs"):
        distributed.select_device("auto", distributed.DistEnv(local_rank=8, world_size=16))


def test_backend_follows_the_device():
    assert distributed.select_backend("auto", torch.device("cpu")) == "gloo"
    assert distributed.select_backend("auto", torch.device("cuda", 0)) == "nccl"
    assert distributed.select_backend("gloo", torch.device("cuda", 0)) == "gloo"
    with pytest.raises(UsageError, match="dist.backend=nccl needs CUDA"):
        distributed.select_backend("nccl", torch.device("cpu"))


def test_single_process_runtime_has_no_group(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    with distributed.process_group("cpu", "auto", 60) as runtime:
        assert runtime.backend is None and runtime.world_size == 1 and runtime.is_main_process
        module, train_model = distributed.prepare_model(torch.nn.BatchNorm1d(3), runtime, True, False)
        assert train_model is module and type(module) is torch.nn.BatchNorm1d  # no sync-BN, no DDP alone
        tensor = torch.tensor([1.0, 2.0])
        assert distributed.all_reduce_sum(tensor) is tensor and tensor.tolist() == [1.0, 2.0]
        assert distributed.broadcast_object({"a": 1}) == {"a": 1}
        with distributed.main_process_first():
            pass


EXIT_SCRIPT = """
import atexit, os, sys
import torch
sys.path.insert(0, {repo!r})
from src.parallel import distributed

class Teardown:
    def __del__(self):
        print("teardown ran", flush=True)

kept_until_teardown = Teardown()
atexit.register(lambda: print("atexit ran", flush=True))
if {join}:
    with distributed.process_group("cpu", "gloo", 60) as runtime:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
        model(torch.ones(2, 3)).sum().backward()
        del model
distributed.exit_after_a_group()
print("returned", flush=True)
"""


@pytest.mark.parametrize("join", [True, False])
def test_a_process_that_ran_a_group_ends_without_the_interpreters_teardown(join: bool):
    """After a DDP group, each rank exits at once: atexit handlers run, the teardown (where the group's
    gloo threads could abort the process) does not. Without a group, nothing changes."""
    from conftest import REPO, free_port

    port = free_port()
    code = EXIT_SCRIPT.format(repo=str(REPO), join=join)
    ranks = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for rank in range(2)]
    for rank in ranks:
        stdout, stderr = rank.communicate(timeout=120)
        assert rank.returncode == 0, stderr[-3000:]
        assert stdout.splitlines() == (["atexit ran"] if join else ["returned", "atexit ran", "teardown ran"])
