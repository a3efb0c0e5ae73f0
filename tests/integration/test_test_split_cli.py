"""The test split through the real command line: every choice is made on val, the test split is read once, when
training ends, with the chosen weights; never before, by nothing that chooses.

A dataset of the fork's own (a module on PYTHONPATH, a YAML in its config folder) wraps the digits and records each
test sample read, per process, in a file: training, validation, checkpoint selection, early stopping and a sweep
with trainer.test=false read none of it; with the final test, every test sample is read exactly once on 1, 2 and 3
ranks, by train.py and by eval.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, check, metrics, run, torchrun, train

pytestmark = pytest.mark.slow

EVAL = str(REPO / "eval.py")
RECORDED = '''
import os
from pathlib import Path

from torch.utils.data import Dataset

from src.components.datasets import digits
from src.data.splits import DataSplits


class Recorded(Dataset):
    """A dataset that writes each index read, one line each, to a file of this process."""

    def __init__(self, dataset, log_dir):
        self.dataset, self.log_dir = dataset, Path(log_dir)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        with open(self.log_dir / f"test-{os.getpid()}.txt", "a") as file:
            file.write(f"{index}\\n")
        return self.dataset[index]


def recorded_digits(log_dir, val_size=180, test_size=179):
    splits = digits(val_size=val_size, test_size=test_size)
    return DataSplits(train=splits.train, val=splits.val, test=Recorded(splits.test, log_dir), info=splits.info,
                      fields=splits.fields, target=splits.target)
'''
YAML = """_target_: recorded.recorded_digits
batch_size: 48       # divides by 1, 2 and 3 ranks
val_batch_size: null
num_workers: 0
log_dir: ???
"""
TEST_SIZE = 179  # odd: shards of 89/90 on 2 ranks, 59/60/60 on 3


@pytest.fixture
def fork(tmp_path: Path) -> tuple[Path, dict[str, str], list[str]]:
    """The fork's module and config folder; its environment and the arguments that choose its dataset."""
    (tmp_path / "recorded.py").write_text(RECORDED)
    (tmp_path / "conf" / "dataset").mkdir(parents=True)
    (tmp_path / "conf" / "dataset" / "recorded.yaml").write_text(YAML)
    (tmp_path / "reads").mkdir()
    args = ["dataset=recorded", f"dataset.log_dir={tmp_path / 'reads'}",
            f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "trainer.progress=false"]
    return tmp_path, {"PYTHONPATH": str(tmp_path)}, args


def reads(workdir: Path) -> list[int]:
    return sorted(int(line) for path in (workdir / "reads").glob("test-*.txt") for line in path.read_text().split())


def test_training_validation_selection_early_stopping_and_a_sweep_never_read_the_test_split(fork):
    workdir, env, args = fork
    choosing = [*args, "trainer.test=false", "trainer.epochs=4", "callbacks.early_stopping.patience=1",
                "trainer.checkpoint_every_steps=5"]
    check(train([*choosing, "hydra.run.dir=run"], workdir, env=env))
    summary = metrics(workdir / "run")
    assert (workdir / "run" / "checkpoints" / "best.pt").exists() and summary["epoch"] >= 2
    assert not any(key.startswith("test") for key in summary)
    check(train(["-m", *choosing, "optimizer.lr=0.01,0.001", f"hydra.sweep.dir={workdir / 'sweep'}"], workdir,
                env=env))
    assert "test/" not in (workdir / "sweep" / "summary.md").read_text()
    assert reads(workdir) == []  # not one test sample read


@pytest.mark.parametrize("processes", [1, 2, 3])
def test_the_final_test_reads_every_test_sample_once_on_any_world_size(fork, processes: int):
    workdir, env, args = fork
    full = [*args, "trainer.epochs=2", "hydra.run.dir=run"]
    check(train(full, workdir, env=env) if processes == 1 else torchrun(processes, full, workdir, env=env))
    assert reads(workdir) == list(range(TEST_SIZE))  # each sample once, over every rank
    summary = metrics(workdir / "run")
    assert summary["test/num_samples"] == TEST_SIZE and summary["world_size"] == processes
    tested = torch.load(workdir / "run" / "checkpoints" / "last.pt", weights_only=True)["loop"]["test"]
    assert tested["metrics"]["test/acc"] == summary["test/acc"] and tested["step"] == summary["step"]
    assert "best.pt" in tested["weights"]  # chosen on val
    for path in (workdir / "reads").glob("*.txt"):
        path.unlink()
    eval_args = [f"checkpoint={workdir / 'run' / 'checkpoints' / 'best.pt'}",
                 f"hydra.searchpath=[file://{workdir / 'conf'}]", f"dataset.log_dir={workdir / 'reads'}",
                 "hydra.run.dir=eval"]
    check(run([sys.executable, EVAL, *eval_args], workdir, env=env) if processes == 1
          else torchrun(processes, eval_args, workdir, script=EVAL, env=env))
    assert reads(workdir) == list(range(TEST_SIZE))
    evaluated = json.loads((workdir / "eval" / "metrics.json").read_text())
    assert evaluated["test/acc"] == summary["test/acc"] and evaluated["num_samples"] == TEST_SIZE
    assert evaluated["test/loss"] == pytest.approx(summary["test/loss"], abs=1e-6)


def test_a_resumed_run_that_has_tested_does_not_test_again(fork):
    workdir, env, args = fork
    full = [*args, "trainer.epochs=2", "hydra.run.dir=run"]
    check(train(full, workdir, env=env))
    assert reads(workdir) == list(range(TEST_SIZE))
    again = check(train([*full, "resume=auto"], workdir, env=env))
    assert reads(workdir) == list(range(TEST_SIZE))  # not read again
    assert "test/acc=" in again.stdout + again.stderr  # the saved result, reported
    assert metrics(workdir / "run")["test/acc"] == torch.load(
        workdir / "run" / "checkpoints" / "last.pt", weights_only=True)["loop"]["test"]["metrics"]["test/acc"]


def test_a_monitor_or_objective_on_test_is_refused_in_one_line(tmp_path: Path):
    refused = train(["trainer.monitor=test/acc"], tmp_path)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        "error: trainer.monitor=test/acc: every choice (best.pt, early stopping, a sweep's objective and ranking) is "
        "made on val, and test is evaluated once, when training ends, to report: monitor val/acc")
