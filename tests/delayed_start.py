"""Run train.py with ranks other than 0 starting late, as happens on a busy node.

Ranks that reach Hydra a second apart used to get different `${now:}` run dirs
(hydra #2070); the integration tests launch this under torchrun to prove one run dir.
"""

import os
import runpy
import sys
import time
from pathlib import Path

if os.environ.get("RANK", "0") != "0":
    time.sleep(float(os.environ.get("START_DELAY_S", "1.5")))
repo = Path(__file__).resolve().parents[1]
train_py = str(repo / "train.py")
sys.argv[0] = train_py
sys.path[0] = str(repo)  # as if train.py had been started directly
runpy.run_path(train_py, run_name="__main__")
