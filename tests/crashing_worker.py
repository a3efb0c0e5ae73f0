"""Run train.py with rank 1 crashing at its 3rd optimizer step (fault injection for tests)."""

import os
import runpy
import sys
from pathlib import Path

repo = Path(__file__).resolve().parents[1]
sys.path[0] = str(repo)  # as if train.py had been started directly

if os.environ.get("RANK") == "1":
    from src import trainer

    original_step = trainer.Trainer._optimizer_step
    calls = {"n": 0}

    def crash_at_third_step(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure on rank 1 at step 3")
        original_step(self)

    trainer.Trainer._optimizer_step = crash_at_third_step

train_py = str(repo / "train.py")
sys.argv[0] = train_py
runpy.run_path(train_py, run_name="__main__")
