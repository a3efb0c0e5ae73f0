"""Run train.py; on the first attempt of a torchrun group, rank 1 damages the run's two newest
checkpoints (last.pt cut short, the newest step_<N>.pt emptied) at its 28th optimizer step and
SIGKILLs itself, as if a node died while its disk failed (fault injection for tests)."""

import os
import runpy
import signal
import sys
from pathlib import Path

repo = Path(__file__).resolve().parents[1]
sys.path[0] = str(repo)  # as if train.py had been started directly

if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    from src import trainer

    original_step = trainer.Trainer._optimizer_step
    calls = {"n": 0}

    def damage_and_die_at_step_28(self):
        calls["n"] += 1
        if calls["n"] == 28:
            checkpoints = self.checkpointer.directory
            last = checkpoints / "last.pt"
            last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
            sorted(checkpoints.glob("step_*.pt"))[-1].write_bytes(b"")
            os.kill(os.getpid(), signal.SIGKILL)
        original_step(self)

    trainer.Trainer._optimizer_step = damage_and_die_at_step_28

train_py = str(repo / "train.py")
sys.argv[0] = train_py
runpy.run_path(train_py, run_name="__main__")
