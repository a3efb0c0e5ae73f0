"""A disk with no room for the next checkpoint: the previous one stays byte for byte, no temp file
is left, and every rank of the group stops at once with one line giving the bytes needed.

The fault is real and needs no privileges: the launcher runs under a file-size limit
(RLIMIT_FSIZE, `ulimit -f`) below a checkpoint's size, so the kernel refuses the write with
EFBIG, as a full disk refuses it with ENOSPC; both take the same path in the template. SIGXFSZ,
which the kernel sends first and which would kill the process, is ignored (as `ulimit -f` shells
often leave it), and that disposition passes to the workers. A tmpfs of a few MB would need root.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TRAIN, copy_run

pytestmark = pytest.mark.slow

LIMIT = 512 * 1024  # bytes: logs, metrics.json and TensorBoard events fit; a 1.8 MB digits checkpoint does not


def file_size_limit() -> None:
    """In the child before exec: writes past LIMIT fail with EFBIG instead of killing the process."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


def test_a_checkpoint_that_does_not_fit_stops_every_rank_and_keeps_the_previous_one(tmp_path: Path,
                                                                                   one_epoch_run: Path):
    copy_run(one_epoch_run, tmp_path / "run")
    checkpoints = tmp_path / "run" / "checkpoints"
    last = checkpoints / "last.pt"
    before = last.read_bytes()

    started = time.monotonic()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", TRAIN,
               "trainer.epochs=2", "resume=auto", "hydra.run.dir=run"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=file_size_limit)
    elapsed = time.monotonic() - started

    output = result.stdout + result.stderr
    assert result.returncode != 0
    error_lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, output[-3000:]
    assert f"cannot write checkpoint {last} (File too large)" in error_lines[0]
    needed = int(re.search(r"it needs ([\d,]+) bytes", error_lines[0]).group(1).replace(",", ""))
    assert abs(needed - len(before)) < 0.05 * len(before)  # the same model: about the same size
    assert f"at most {LIMIT:,} bytes" in error_lines[0]
    ours = (f'File "{REPO}/src/', f'File "{REPO}/train.py"')
    assert not [line for line in output.splitlines() if line.strip().startswith(ours)], output[-3000:]
    assert "UsageError" not in output
    assert last.read_bytes() == before
    assert sorted(p.name for p in checkpoints.iterdir()) == ["best.pt", "last.pt"]  # no .tmp left behind
    assert "resumed from" in (tmp_path / "run" / "train.log").read_text()  # it got as far as the save
    assert elapsed < 60
    print(f"failing group ended {elapsed:.1f} s after torchrun started")
