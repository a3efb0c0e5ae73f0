"""benchmarks/chaos.py, three trials: workers SIGKILLed 3 times each at random moments under
`torchrun --max-restarts=5`, and every run still ends bitwise equal to an uninterrupted one."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from conftest import REPO, run

pytestmark = pytest.mark.slow


@pytest.mark.timeout(960)  # its command may take run()'s 900 s; then its output is the report
def test_three_chaos_trials_end_bitwise_equal(tmp_path: Path):
    result = run([sys.executable, str(REPO / "benchmarks" / "chaos.py"), "--trials", "3", "--workdir", str(tmp_path)],
                 tmp_path, timeout=900)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "3/3 trials equal to the uninterrupted run" in result.stdout
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (\d+) \| (\d+) \|", result.stdout, re.M)
    assert len(rows) == 3 and all(int(kills) == 3 for _, kills, _, _ in rows)
    assert sum(int(resumes) for _, _, resumes, _ in rows) > 0  # some kills came after a checkpoint
    # A kill costs at most the steps since the last checkpoint (every 7 steps), never a restart from scratch.
    assert all(int(redone) <= 7 * int(kills) for _, kills, _, redone in rows), rows
