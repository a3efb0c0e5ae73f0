"""`trainer.compile=true`: torch.compile (TorchInductor, C++ kernels built with the system compiler
on the CPU) trains like the eager model, and checkpoints hold the plain module's state, so a
compiled run resumes or evaluates without compiling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import check, metrics, torchrun, train, weights

from src import checkpoint
from src.components.models import SimpleCNN

pytestmark = pytest.mark.slow

# Five steps and two val batches: compiling (25-40 s on 2 cores, cold) is what takes the time. SGD: Adam's
# update m/sqrt(v) would blow float-rounding differences of near-zero gradients up to the size of the LR.
SHORT = ["trainer.epochs=1", "trainer.limit_train_batches=5", "trainer.limit_val_batches=2", "optimizer=sgd"]


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory) -> dict[str, str]:
    """A kernel cache of this module's own: the compile itself is under test, not kernels an earlier run left
    behind. The FSDP test after the first reuses its CNN kernels (graph capture still runs: ~10 s less)."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor-cache"))}


def test_a_compiled_run_trains_like_the_eager_model_and_saves_plain_weights(tmp_path: Path, inductor_cache):
    compiled_env = inductor_cache
    check(train([*SHORT, "trainer.compile=true", "hydra.run.dir=compiled"], tmp_path, env=compiled_env, timeout=600))
    check(train([*SHORT, "hydra.run.dir=eager"], tmp_path))
    compiled, eager = metrics(tmp_path / "compiled"), metrics(tmp_path / "eager")
    assert compiled["step"] == eager["step"] == 5
    # Inductor fuses and reorders float operations: the same steps, equal up to float rounding.
    for key in ("train/loss", "val/loss"):
        assert compiled[key] == pytest.approx(eager[key], rel=1e-4), key
    assert compiled["val/acc"] == eager["val/acc"]
    saved, reference = weights(tmp_path / "compiled"), weights(tmp_path / "eager")
    assert list(saved) == list(SimpleCNN(1, (8, 8), 10).state_dict())  # no `_orig_mod.` prefixes
    # Per tensor, not per element: Inductor's vectorised kernels (AVX-512 on some machines of this kind) sum in
    # another order, and 5 SGD steps at lr 0.1 grow that to 2e-4 on single near-zero weights (measured on the
    # unchanged template too). Relative to each tensor's norm it stays below 1.1e-3; a wrong kernel is off by far more.
    for name, tensor in saved.items():
        if tensor.is_floating_point():
            assert (tensor - reference[name]).norm() <= 2e-3 * reference[name].norm() + 1e-7, name
        else:
            assert torch.equal(tensor, reference[name]), name

    # The compiled run's checkpoint goes on in eager mode.
    check(train([*SHORT, "trainer.epochs=2", "resume=auto", "hydra.run.dir=compiled"], tmp_path))
    resumed = metrics(tmp_path / "compiled")
    assert (resumed["epoch"], resumed["step"]) == (2, 10)
    assert "resumed from" in (tmp_path / "compiled" / "train.log").read_text()


def test_a_compiled_fsdp_run_trains_like_the_eager_fsdp_run(tmp_path: Path, inductor_cache):
    """`trainer.compile=true` on the sharded model (dist=fsdp, each child a unit: FSDP2's hooks around every
    unit in the compiled graph), 2 ranks: the same steps, metrics and weights as the eager sharded run."""
    args = [*SHORT, "dist=fsdp", "dist.fsdp.min_unit_params=0"]
    check(torchrun(2, [*args, "trainer.compile=true", "hydra.run.dir=compiled"], tmp_path, env=inductor_cache,
                   timeout=600))
    check(torchrun(2, [*args, "hydra.run.dir=eager"], tmp_path))
    compiled, eager = metrics(tmp_path / "compiled"), metrics(tmp_path / "eager")
    assert compiled["step"] == eager["step"] == 5 and compiled["world_size"] == 2
    for key in ("train/loss", "val/loss"):
        assert compiled[key] == pytest.approx(eager[key], rel=1e-4), key
    assert compiled["val/acc"] == eager["val/acc"]
    saved, reference = (checkpoint.read(tmp_path / run / "checkpoints" / "last").model_weights()
                        for run in ("compiled", "eager"))
    assert list(saved) == list(reference)  # the plain module's names: no `_orig_mod.` prefixes
    for name, tensor in saved.items():  # as above: per tensor, relative to its norm
        if tensor.is_floating_point():
            assert (tensor - reference[name]).norm() <= 2e-3 * reference[name].norm() + 1e-7, name
