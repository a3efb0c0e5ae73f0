"""The fault tests' process helper (tests/fixtures/faults.py): `Launched.kill_all` ends what a launch left running,
also a process below it in a session of its own, as torchrun starts its workers."""

from __future__ import annotations

import sys
from pathlib import Path

from faults import Launched, is_alive, wait_until

# A launcher whose child starts a session of its own (torch elastic's workers do), prints its pid, and sleeps.
LAUNCHER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def test_kill_all_ends_a_child_in_a_session_of_its_own(tmp_path: Path):
    launched = Launched()
    launcher = launched.start([sys.executable, "-c", LAUNCHER], tmp_path)
    out = tmp_path / "launcher.out"
    wait_until(lambda: out.read_text().strip(), 60, "the launcher's child to start")
    child = int(out.read_text())
    assert is_alive(child)
    launched.kill_all()
    assert launcher.returncode is not None
    wait_until(lambda: not is_alive(child), 10, "the child to die")
