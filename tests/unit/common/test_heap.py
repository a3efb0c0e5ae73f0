"""src/common/heap.py: no cyclic collection while a process starts; start-up's objects frozen after."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def run_python(code: str, cwd: Path = REPO) -> dict:
    """Run `code` in a fresh interpreter (the collector's state is per process); it prints JSON."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_pause_then_resume_freezes_what_exists_and_collects_what_comes_after():
    seen = run_python("""
        import gc, json, sys
        sys.path.insert(0, ".")
        from src.common import heap
        heap.pause_collection()
        paused = not gc.isenabled()
        startup = [[] for _ in range(5000)]          # long-lived start-up objects
        for _ in range(3):                           # start-up's cyclic garbage
            loop = []; loop.append(loop)
        del loop
        heap.resume_collection()
        frozen = gc.get_freeze_count()
        heap.resume_collection()                     # a second call changes nothing
        cycle = []; cycle.append(cycle); del cycle   # the run's cyclic garbage
        print(json.dumps({"paused": paused, "enabled": gc.isenabled(), "frozen": frozen,
                          "frozen_again": gc.get_freeze_count(), "collected": gc.collect()}))
    """)
    assert seen["paused"] and seen["enabled"]
    assert seen["frozen"] >= 5000 and seen["frozen_again"] == seen["frozen"]
    assert seen["collected"] == 1  # only the cycle made after resuming; the frozen ones stay


def test_resume_leaves_a_collector_it_did_not_pause_alone():
    seen = run_python("""
        import gc, json, sys
        sys.path.insert(0, ".")
        from src.common import heap
        gc.disable()                 # someone else's choice (e.g. a caller embedding the template)
        heap.pause_collection()
        heap.resume_collection()
        still_off = not gc.isenabled()
        gc.enable()
        heap.resume_collection()     # nor freezes anything when it never paused
        print(json.dumps({"still_off": still_off, "frozen": gc.get_freeze_count()}))
    """)
    assert seen == {"still_off": True, "frozen": 0}


@pytest.mark.slow
def test_a_training_process_collects_again_with_its_imports_frozen(tmp_path: Path):
    """The real entry point: by the end of a run the collector is on, and torch's and Hydra's
    objects were frozen when the run began."""
    seen = run_python(f"""
        import atexit, gc, json, runpy, sys
        sys.path.insert(0, ".")
        sys.argv = ["train.py", "trainer.epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
                    "hydra.run.dir={tmp_path / 'run'}"]
        atexit.register(lambda: print(json.dumps({{"enabled": gc.isenabled(), "frozen": gc.get_freeze_count(),
                                                  "torch_imported": "torch" in sys.modules}})))
        runpy.run_path("train.py", run_name="__main__")
    """)
    assert seen["enabled"] and seen["torch_imported"]
    assert seen["frozen"] > 100_000  # torch, Hydra and the rest of start-up: never walked again
    assert (tmp_path / "run" / "metrics.json").exists()
