"""An allocation the process has no memory for keeps its traceback and gains a note naming the rank, the size, the
process's limit and what shrinks a rank's share; a ${KEY} naming no key of the config is a usage error; a sweep job's
usage error is its line, and one line again as the sweep ends (src/common/errors.py)."""

from __future__ import annotations

import gc
import subprocess
import sys
import traceback
import weakref

import pytest
import torch
from hydra.conf import HydraConf
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationKeyError

from src.common import errors

HINT = ("the model's training state does not fit one process: under dist=ddp use dist=fsdp, which keeps 1/W of the "
        "parameters, gradients and optimizer state on each of W ranks; under dist=fsdp use more ranks "
        "(torchrun --nproc_per_node=N) or a smaller per-rank batch")

# A process under a 3 GiB data limit (ulimit -d) asks torch for 8 GiB, in a function of its own: the kernel refuses
# the allocation, and the traceback shows where it was asked for.
OVER_THE_LIMIT = """
import resource, sys
sys.path.insert(0, {repo!r})
import torch
from src.common import errors
resource.setrlimit(resource.RLIMIT_DATA, (3 * 2**30, resource.RLIM_INFINITY))


def forward_of_a_fork():
    return torch.empty(2 * 2**30, dtype=torch.float32)


with errors.exit_on_usage_error(is_main_process=True):
    forward_of_a_fork()
"""


def test_a_real_allocation_over_the_data_limit_keeps_its_traceback_and_names_the_limit_and_fsdp(tmp_path):
    from conftest import REPO

    (tmp_path / "fork.py").write_text(OVER_THE_LIMIT.format(repo=str(REPO)))
    result = subprocess.run([sys.executable, str(tmp_path / "fork.py")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert 'in forward_of_a_fork' in result.stderr and "return torch.empty(2 * 2**30" in result.stderr  # the place
    assert "DefaultCPUAllocator: can't allocate memory" in result.stderr  # torch's own message
    assert lines[-1] == (f"out of memory on rank 0 (tried to allocate 8589934592 bytes), limits: data (ulimit -d) "
                         f"3,072 MiB: {HINT}")


@pytest.mark.parametrize("error,asked", [(MemoryError(), "MemoryError"),
                                         (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                          "Tried to allocate 2.00 GiB")])
def test_python_s_and_cuda_s_out_of_memory_get_the_note_too(error: BaseException, asked: str):
    with pytest.raises(type(error)) as raised, errors.exit_on_usage_error(is_main_process=True):
        raise error
    assert raised.value is error
    [note] = raised.value.__notes__
    assert note.startswith(f"out of memory on rank 0 ({asked}), ") and note.endswith(HINT)


def test_other_runtime_errors_pass_through_without_a_note():
    with pytest.raises(RuntimeError, match="shape mismatch") as raised, errors.exit_on_usage_error(True):
        raise RuntimeError("shape mismatch")
    assert not hasattr(raised.value, "__notes__")


def test_an_out_of_memory_a_model_constructor_raised_inside_hydra_s_instantiate_gets_the_note_too():
    """A model without an initialisation hook is built whole under dist=fsdp, through hydra's instantiate, which
    wraps what the constructor raised (and prints only its message): torch's error comes out, with its traceback
    (the constructor's frames) and the note."""
    from hydra.errors import InstantiationException

    allocator = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 37748736 bytes.")

    def constructor():
        raise allocator

    with pytest.raises(RuntimeError) as raised, errors.exit_on_usage_error(True):
        try:
            constructor()
        except RuntimeError as error:
            raise InstantiationException("Error in call to target 'src.components.models.MLP'") from error
    assert raised.value is allocator and "constructor" in [entry.name for entry in raised.traceback]
    assert raised.value.__notes__[0].startswith("out of memory on rank 0 (tried to allocate 37748736 bytes), ")
    with pytest.raises(InstantiationException) as raised, errors.exit_on_usage_error(True):
        raise InstantiationException("Error in call to target 'src.components.models.MLP': TypeError(...)")
    assert not hasattr(raised.value, "__notes__")


def test_an_interpolation_naming_no_key_is_a_usage_error_naming_the_key_it_resolved():
    """`${nope}` in model.hidden (OmegaConf names the key it resolved), and one Hydra resolves on its own (no key)."""
    config = OmegaConf.create({"model": {"hidden": "${nope}"}})
    with pytest.raises(InterpolationKeyError) as raised:
        OmegaConf.to_container(config, resolve=True)
    try:
        raise RuntimeError("Hydra's wrapper") from raised.value
    except RuntimeError as wrapped:
        found = errors.find_usage_error(wrapped)
    assert str(found) == "model.hidden: Interpolation key 'nope' not found: set that key in its YAML or with +KEY=VALUE"
    bare = errors.find_usage_error(InterpolationKeyError("Interpolation key 'task.monitor' not found"))
    assert str(bare) == ("the config: Interpolation key 'task.monitor' not found: set that key in its YAML or with "
                         "+KEY=VALUE")
    usage = errors.UsageError("a line")
    assert errors.find_usage_error(RuntimeError()) is None and errors.find_usage_error(usage) is usage


def test_an_interpolation_of_a_group_s_key_names_the_option_that_lacks_it(monkeypatch):
    """`${task.latent_size}` in a GAN's model config, run with task=classification: the line names that choice."""
    config = OmegaConf.create({"model": {"in_features": "${task.latent_size}"}, "task": {"monitor": "val/acc"}})
    with pytest.raises(InterpolationKeyError) as raised:
        OmegaConf.to_container(config, resolve=True)
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)  # restored afterwards: the job's, if any
    hydra = OmegaConf.create({"hydra": OmegaConf.structured(HydraConf)})
    hydra.hydra.runtime.choices = {"task": "classification", "model": "gan_mlp"}
    HydraConfig.instance().set_config(hydra)
    assert str(errors.find_usage_error(raised.value)) == (
        "model.in_features: Interpolation key 'task.latent_size' not found: task=classification does not set it: "
        "choose a task that does, or add +task.latent_size=VALUE")
    unchosen = errors.find_usage_error(InterpolationKeyError("Interpolation key 'trainer.nope' not found"))
    assert str(unchosen).endswith("not found: set that key in its YAML or with +KEY=VALUE")  # not a group's key


def test_a_sweep_job_s_usage_error_is_its_line_now_and_one_line_hydra_prints_as_the_sweep_ends(capsys):
    """In a sweep the job's line is printed as the job stops, then raised for Hydra to mark the job failed: as a
    UsageError, a CompactHydraException, which Hydra prints as its message alone (not as a traceback)."""
    from hydra.errors import CompactHydraException

    usage = errors.UsageError("optimizer.lr=-1 must be a number >= 0")
    with pytest.raises(errors.UsageError) as raised, errors.exit_on_usage_error(True, in_sweep=True):
        raise RuntimeError("Hydra's wrapper") from usage
    assert isinstance(raised.value, CompactHydraException) and raised.value.__cause__ is usage
    assert str(raised.value) == "error: optimizer.lr=-1 must be a number >= 0"
    assert capsys.readouterr().err == "error: optimizer.lr=-1 must be a number >= 0\n"
    with pytest.raises(errors.UsageError) as raised, errors.exit_on_usage_error(True, in_sweep=True):
        raise errors.WorkersReportedUsageError("the workers stopped on the error above")
    assert str(raised.value) == "error: the workers stopped on the error above"
    assert capsys.readouterr().err == ""  # the workers printed theirs
    with pytest.raises(RuntimeError, match="shape mismatch"), errors.exit_on_usage_error(True, in_sweep=True):
        raise RuntimeError("shape mismatch")  # not the user's to fix: its traceback, in a sweep too



class Model:
    """A job's model in a reference cycle (as a trainer and its parts hold theirs): freed only by Python's cyclic
    garbage collector."""

    def __init__(self) -> None:
        self.weight, self.me = torch.zeros(1000), self


def _job(models: list[weakref.ref], fails: bool) -> None:
    model = Model()
    models.append(weakref.ref(model.weight))
    if fails:
        raise RuntimeError("a job's crash")


@pytest.mark.parametrize("fails", [False, True], ids=["completed", "failed"])
@pytest.mark.parametrize("in_sweep", [True, False], ids=["sweep", "single-run"])
def test_a_sweep_job_s_model_is_freed_as_the_job_ends_however_it_ends(fails: bool, in_sweep: bool):
    """A sweep's next job runs in this process: a job's model and optimizer (a GPU's memory) go as the job ends, not
    when Python's collector next runs, and the error Hydra keeps of a failed job until the sweep ends holds no frame
    of the job with its locals. (A single run exits instead: nothing is collected or cleared.)"""
    models: list[weakref.ref] = []
    raised = None
    gc.disable()  # the collector runs only where exit_on_usage_error runs it
    try:
        try:
            with errors.exit_on_usage_error(True, in_sweep=in_sweep):
                _job(models, fails)
        except RuntimeError as error:
            raised = error  # kept, as Hydra's JobReturn keeps it
        assert (models[0]() is None) == in_sweep
    finally:
        gc.enable()
    assert (raised is not None) == fails
    if fails:  # the report still says where it happened
        assert 'in _job\n    raise RuntimeError("a job\'s crash")' in "".join(traceback.format_exception(raised))
