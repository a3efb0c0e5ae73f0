"""No pointless retries: under `torchrun --max-restarts=3`, an error every restart would hit again (a NaN
loss, a missing dataset folder, checkpoints that are all unreadable) ends the run in about the time of one
attempt, with its one-line reason; the restarts exit before doing any work."""

from __future__ import annotations

import sys
import time
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


def timed_torchrun(max_restarts: int, args: list[str], cwd: Path) -> tuple[float, str]:
    """Seconds a failing `torchrun --max-restarts=N` took, and its stderr."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               f"--max-restarts={max_restarts}", TRAIN, *args]
    started = time.monotonic()
    result = run(command, cwd, timeout=300)
    assert result.returncode != 0
    return time.monotonic() - started, result.stderr


@pytest.mark.parametrize("case", CASES)
def test_an_error_every_restart_would_hit_is_not_retried(case: str, workdir: Path, request):
    make_args, reason = CASES[case]
    corrupt = request.getfixturevalue("corrupt_run") if case == "every-checkpoint-corrupt" else None
    single, _ = timed_torchrun(0, make_args(workdir / "single", corrupt), workdir)
    restarted, stderr = timed_torchrun(3, make_args(workdir / "restarted", corrupt), workdir)
    print(f"{case}: one attempt {single:.1f} s, --max-restarts=3 {restarted:.1f} s ({restarted / single:.2f}x)")
    reasons = [line for line in stderr.splitlines() if line.startswith(reason)]
    assert len(reasons) == 4  # the first attempt's, then once per restart cut short
    assert all("(not retried: every restart would stop on it)" in line for line in reasons[1:])
    # The time ratio is printed, not asserted: speed is shown on an idle machine, never by a timed assertion
    # in the suite, where the other test worker shares the cores (README: 1.08-1.17x measured alone).
