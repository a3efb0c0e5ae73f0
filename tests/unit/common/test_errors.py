"""An allocation the process has no memory for is one line naming its limit (src/common/errors.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from src.common import errors

# A process under a 3 GiB data limit (ulimit -d) asks torch for 8 GiB: the kernel refuses the allocation.
OVER_THE_LIMIT = """
import resource, sys
sys.path.insert(0, {repo!r})
import torch
from src.common import errors
resource.setrlimit(resource.RLIMIT_DATA, (3 * 2**30, resource.RLIM_INFINITY))
try:
    with errors.out_of_memory_is_one_line("ddp"):
        torch.empty(2 * 2**30, dtype=torch.float32)
except errors.UsageError as error:
    print(error, error.local)
"""


def test_a_real_allocation_over_the_data_limit_is_one_line_naming_the_limit_and_fsdp():
    from conftest import REPO

    result = subprocess.run([sys.executable, "-c", OVER_THE_LIMIT.format(repo=str(REPO))], capture_output=True,
                            text=True, timeout=120)
    line = result.stdout.strip()
    assert result.returncode == 0 and len(line.splitlines()) == 1, result.stderr[-2000:]
    assert line.startswith("out of memory on rank 0 (tried to allocate 8589934592 bytes)") and line.endswith(" True")
    assert "under dist=ddp, limits: data (ulimit -d) 3,072 MiB: the model's training state does not fit one" in line
    assert "use dist=fsdp, which keeps 1/W of the parameters, gradients and optimizer state on each of W" in line


@pytest.mark.parametrize("error", [MemoryError(), RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")])
def test_python_s_and_cuda_s_out_of_memory_are_one_line_too(error: BaseException):
    line = (r"^out of memory on rank \d+ \((MemoryError|Tried to allocate 2.00 GiB)\) under dist=fsdp, .*: use more "
            r"ranks \(torchrun --nproc_per_node=N\)$")
    with pytest.raises(errors.UsageError, match=line):
        with errors.out_of_memory_is_one_line("fsdp"):
            raise error


def test_other_runtime_errors_pass_through():
    with pytest.raises(RuntimeError, match="shape mismatch"), errors.out_of_memory_is_one_line("ddp"):
        raise RuntimeError("shape mismatch")


def test_an_out_of_memory_a_model_constructor_raised_inside_hydra_s_instantiate_is_one_line_too():
    """A model without an initialisation hook is built whole under dist=fsdp, through hydra's instantiate, which
    wraps what the constructor raised."""
    from hydra.errors import InstantiationException

    allocator = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 37748736 bytes.")
    with pytest.raises(errors.UsageError, match=r"^out of memory on rank \d+ \(tried to allocate 37748736 bytes\) "
                                                r"under dist=fsdp, .*: use more ranks \(torchrun --nproc_per_node=N\)$"):
        with errors.out_of_memory_is_one_line("fsdp"):
            try:
                raise allocator
            except RuntimeError as error:
                raise InstantiationException("Error in call to target 'src.components.models.MLP'") from error
    with pytest.raises(InstantiationException), errors.out_of_memory_is_one_line("fsdp"):
        raise InstantiationException("Error in call to target 'src.components.models.MLP': TypeError(...)")
