"""No pointless retries: under `torchrun --max-restarts=3`, an error every restart would hit again (a NaN
loss, a missing dataset folder, checkpoints that are all unreadable) ends the run with its one-line reason; the
restarts exit before doing any work, each with the reason and that it was not retried. (How long that takes
against one attempt is in docs/fault-tolerance.md's measurements; the suite does not time it.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import TRAIN, check, run, torchrun

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def corrupt_run(tmp_path_factory) -> Path:
    """A run dir whose every checkpoint (last, best, step) is truncated."""
    workdir = tmp_path_factory.mktemp("corrupt")
    check(torchrun(2, ["trainer.epochs=1", "trainer.checkpoint_every_steps=5", "hydra.run.dir=run"], workdir))
    checkpoints = list((workdir / "run" / "checkpoints").glob("*.pt"))
    assert len(checkpoints) >= 3
    for path in checkpoints:
        path.write_bytes(path.read_bytes()[:1000])
    return workdir / "run"


CASES = {
    "nan-loss": (lambda work, corrupt: ["optimizer=sgd", "optimizer.lr=1e30", "trainer.log_every_steps=5",
                                         "trainer.epochs=1", f"hydra.run.dir={work / 'run'}"],
                 "error: the loss became NaN or infinite at optimizer step"),
    "missing-dataset-folder": (lambda work, corrupt: ["dataset=image_folder", f"dataset.root={work / 'nothing'}",
                                                       f"hydra.run.dir={work / 'run'}"],
                               "error: image folder"),
    "every-checkpoint-corrupt": (lambda work, corrupt: ["trainer.epochs=2", "resume=auto",
                                                         f"hydra.run.dir={corrupt}"],
                                 "error: checkpoint"),
}


def failed_torchrun(args: list[str], cwd: Path) -> str:
    """The stderr of a failing `torchrun --max-restarts=3`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "--max-restarts=3", TRAIN, *args]
    result = run(command, cwd, timeout=300)
    assert result.returncode != 0
    return result.stderr


@pytest.mark.parametrize("case", CASES)
def test_an_error_every_restart_would_hit_is_not_retried(case: str, workdir: Path, request):
    make_args, reason = CASES[case]
    corrupt = request.getfixturevalue("corrupt_run") if case == "every-checkpoint-corrupt" else None
    stderr = failed_torchrun(make_args(workdir / "restarted", corrupt), workdir)
    reasons = [line for line in stderr.splitlines() if line.startswith(reason)]
    assert len(reasons) == 4  # the first attempt's, then once per restart cut short
    assert all("(not retried: every restart would stop on it)" in line for line in reasons[1:])
