"""dist=fsdp for models that do not fit, through the real command line: the model is built on the meta device
and each rank initialises only its shards, to the very weights a dist=ddp run starts from, on any world size.

Initial weights are read from a checkpoint after one SGD step at lr=0 (the step changes no parameter; only
BatchNorm's running statistics, which see each rank's batches, and are left out of the comparison).
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import TRAIN, check, torchrun, weights
from faults import TORCHRUN
from lazy_runs import LazyRuns

from src import checkpoint

pytestmark = pytest.mark.slow

FIRST_STEP = ["model=cnn", "optimizer=sgd", "optimizer.lr=0", "scheduler=constant", "trainer.max_steps=1",
              "dataset.batch_size=48", "trainer.progress=false", "trainer.limit_val_batches=1"]
FSDP = ["dist=fsdp", "dist.fsdp.min_unit_params=0"]  # the CNN's two children sharded as units of their own
RUNS: dict[str, tuple[int, list[str]]] = {
    "ddp on 2": (2, FIRST_STEP),
    "fsdp on 1": (1, [*FIRST_STEP, *FSDP]),
    "fsdp on 2": (2, [*FIRST_STEP, *FSDP]),
    "fsdp on 3": (3, [*FIRST_STEP, *FSDP]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> LazyRuns:
    return LazyRuns(tmp_path_factory.mktemp("fsdp_large"), RUNS)


def parameters(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model's parameters (no buffers) in the run's newest checkpoint, of either format."""
    saved = (weights(run_dir) if (run_dir / "checkpoints" / "last.pt").exists()
             else checkpoint.read(run_dir / "checkpoints" / "last").model_weights())
    return {name: tensor for name, tensor in saved.items() if "running_" not in name and "num_batches" not in name}


@pytest.mark.parametrize("name", ["fsdp on 1", "fsdp on 2", "fsdp on 3"])
def test_fsdp_builds_on_meta_and_starts_from_the_ddp_run_s_weights_on_any_world_size(runs: LazyRuns, name: str):
    ddp, fsdp = parameters(runs("ddp on 2")), parameters(runs(name))
    assert len(ddp) == 10 and ddp.keys() == fsdp.keys()
    assert all(torch.equal(ddp[key], fsdp[key]) for key in ddp)
    log = (runs(name) / "train.log").read_text()
    assert "the model is built on the meta device; each rank allocates only its shards" in log
    assert "the model is built on the meta device" not in (runs("ddp on 2") / "train.log").read_text()



def test_init_from_loads_a_ddp_checkpoint_into_the_shards_of_a_model_built_on_meta(runs: LazyRuns, tmp_path: Path):
    """Seed 1 would draw other weights: every parameter is the file's (the ddp run's, seed 0)."""
    source = runs("ddp on 2") / "checkpoints" / "last.pt"
    check(torchrun(2, [*FIRST_STEP, *FSDP, "seed=1", f"init_from={source}", "hydra.run.dir=run"], tmp_path))
    loaded, ddp = parameters(tmp_path / "run"), parameters(runs("ddp on 2"))
    assert loaded.keys() == ddp.keys() and all(torch.equal(loaded[key], ddp[key]) for key in ddp)
    assert "init_from: loaded 16 of the model's 16 tensors" in (tmp_path / "run" / "train.log").read_text()

# -- a model over one process's memory limit ----------------------------------------------------------------------

# An MLP of 50.6M parameters on the digits (three 4096x4096 layers: 16P = 810 MB of fp32 training state with
# AdamW), 3 steps on 2 ranks, under a 1,800 MiB data limit per process (RLIMIT_DATA, `ulimit -d`: the heap and
# every private mapping; RLIMIT_AS would count the CUDA build's ~3 GB of mapped libraries). Start-up (torch, the
# process group, the data) takes ~0.9 GB of it. Measured peaks of VmData per rank: dist=ddp 2.03 GB (everything
# whole, and DDP's gradient buckets), dist=fsdp 1.58 GB.
BIG = ["model=mlp", "model.hidden_sizes=[4096,4096,4096,4096]", "optimizer=adamw", "optimizer.fused=null",
       "trainer.max_steps=3", "trainer.progress=false", "trainer.save_checkpoints=false"]
DATA_LIMIT = 1800 * 2**20


def data_limit() -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (DATA_LIMIT, resource.RLIM_INFINITY))


def limited_torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """2 ranks of train.py under torchrun, torchrun and its workers under the data limit."""
    return subprocess.run([*TORCHRUN, "--standalone", "--nproc_per_node=2", TRAIN, *args], cwd=cwd, timeout=300,
                          capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                          preexec_fn=data_limit)


def test_a_model_over_the_memory_limit_trains_sharded_and_ddp_stops_with_one_line(tmp_path: Path):
    sharded = limited_torchrun([*BIG, "dist=fsdp", "hydra.run.dir=fsdp"], tmp_path)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert "stopped at step 3" in sharded.stdout
    whole = limited_torchrun([*BIG, "hydra.run.dir=ddp"], tmp_path)
    errors = [line for line in whole.stderr.splitlines() if line.startswith("error:")]
    assert whole.returncode != 0 and errors  # no worker's traceback: torch's allocator error is not shown
    assert "DefaultCPUAllocator" not in whole.stderr and "RuntimeError" not in whole.stderr
    for line in errors:  # each rank that ran out says so
        assert re.fullmatch(r"error: out of memory on rank [01] \(tried to allocate \d+ bytes\) under dist=ddp, "
                            r"limits: data \(ulimit -d\) 1,800 MiB: the model's training state does not fit one "
                            r"process: use dist=fsdp, which keeps 1/W of the parameters, gradients and optimizer state "
                            r"on each of W ranks", line), line

