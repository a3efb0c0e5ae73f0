"""Chaos trials: kill random workers at random moments; every run must still end bitwise equal to an
uninterrupted one.

    python benchmarks/chaos.py                          # 10 trials, 3 kills each, seed 0
    python benchmarks/chaos.py --trials 50 --seed 7 --kills 3 --max-restarts 5 --epochs 8

Each trial runs `torchrun --standalone --nproc_per_node=2 --max-restarts=R train.py` on digits with
step checkpoints, and SIGKILLs a random worker `--kills` times, each at a random moment of the running
group (start-up, a step, a checkpoint write, evaluation). torchrun restarts the group, which resumes from
its last checkpoint. The trial passes when torchrun exits 0 and the final weights (every tensor of
last.pt's model) and metrics.json (timings aside) equal the uninterrupted run's. Exit code 1 if any
trial fails. Not a CI test (a few minutes per 10 trials); `tests/integration/test_chaos.py` runs 3 trials.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "train.py")
# A train scalar every step: each attempt logs every step it completes, so the steps logged more than once
# across a run's TensorBoard files are the steps a kill made it train again.
ARGS = ["optimizer=sgd", "scheduler=constant", "trainer.checkpoint_every_steps=7",
        "trainer.progress=false", "trainer.log_every_steps=1"]
TIMING_KEYS = {"epoch_time_s", "samples_per_s"}
START_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[INFO\] run dir .* \| world size", re.M)


@dataclass
class Trial:
    seed: int
    kills: int  # workers killed (fewer than asked if the run ended first)
    resumes: int  # restarts that resumed from a checkpoint (the others came before the first one)
    redone: int  # optimizer steps trained twice (or more) because a kill lost them
    seconds: float
    returncode: int
    equal: bool


def torchrun(max_restarts: int, run_dir: Path, epochs: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            f"--max-restarts={max_restarts}", TRAIN, *ARGS, f"trainer.epochs={epochs}", f"hydra.run.dir={run_dir}"]


def worker_pids(agent: int) -> dict[int, int]:
    """{rank: pid} of the live workers torchrun process `agent` started."""
    workers = {}
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if fields.get("PPid", "").strip() == str(agent) and not fields.get("State", "Z").startswith("Z"):
            ranks = [item[5:] for item in environ if item.startswith(b"RANK=")]
            if ranks:
                workers[int(ranks[0])] = int(entry.name)
    return workers


@dataclass(frozen=True)
class Phases:
    """When kills fall, measured on the uninterrupted run: its start-up (launch to first step) and training."""

    startup_s: float
    training_s: float

    def draw(self, rng: random.Random, kills: int) -> tuple[bool, float]:
        """(in training?, seconds): 30% of kills within start-up (rendezvous, imports, dataset), counted from the
        group's start and falling at its first step at the latest; the rest within the first 1/(kills+1) of
        training (a step, a checkpoint write, evaluation), counted from the group's first step. The groups
        killed then train less than the whole run together, so every kill lands before the run could end."""
        if rng.random() < 0.3:
            return False, rng.uniform(0, self.startup_s)
        return True, rng.uniform(0, self.training_s / (kills + 1))


def run_trial(seed: int, workdir: Path, kills: int, max_restarts: int, phases: Phases,
              reference: Path, epochs: int) -> Trial:
    """One run with `kills` random workers SIGKILLed, each at a moment `phases` draws."""
    rng = random.Random(seed)
    run_dir = workdir / f"trial_{seed}"
    log = open(workdir / f"trial_{seed}.log", "w")
    started = time.monotonic()
    agent = subprocess.Popen(torchrun(max_restarts, run_dir, epochs), cwd=workdir, stdout=log, stderr=log,
                             start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    done = 0
    try:
        while done < kills and agent.poll() is None:
            group = _wait_for_group(agent, set())
            if group is None:
                break
            lines_before = _start_lines(run_dir / "train.log")  # groups of this run that reached their first step
            in_training, delay = phases.draw(rng, kills)
            if in_training:  # a step, a checkpoint write or evaluation
                if not _wait_for_first_step(agent, run_dir / "train.log", lines_before):
                    break
                time.sleep(delay)
            else:  # start-up, measured on the uninterrupted run's first group: a restarted group may start faster,
                # and its run (resumed) end sooner than `delay`; so at the latest at this group's first step
                _wait_for_first_step(agent, run_dir / "train.log", lines_before, timeout=delay)
            victim = worker_pids(agent.pid).get(rng.choice(sorted(group)))
            if victim is None or agent.poll() is not None:
                break
            os.kill(victim, signal.SIGKILL)
            done += 1
            _wait_for_group(agent, set(group.values()))  # torchrun restarted the group
        returncode = agent.wait(timeout=600)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        log.close()
    equal = returncode == 0 and same_run(run_dir, reference)
    resumes = (run_dir / "train.log").read_text().count("resumed from") if (run_dir / "train.log").exists() else 0
    return Trial(seed, done, resumes, steps_redone(run_dir), time.monotonic() - started, returncode, equal)


def steps_redone(run_dir: Path) -> int:
    """Optimizer steps logged more than once in the run's TensorBoard files: trained again after a kill.
    A step a kill interrupted before it was logged is not counted (less than one step per kill)."""
    from collections import Counter

    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    logged: Counter[int] = Counter()
    for events in (run_dir / "tb").glob("events.out.tfevents.*"):
        for event in EventFileLoader(str(events)).Load():
            if any(value.tag == "train/loss" for value in event.summary.value):
                logged[event.step] += 1
    return sum(count - 1 for count in logged.values())


def _wait_for_first_step(agent: subprocess.Popen, log: Path, lines_before: int, timeout: float = 120) -> bool:
    """Wait until the current group has logged its start line (right before its first step): the run's log
    then holds more start lines than the `lines_before` it held when the group started. False if torchrun
    ended first, or `timeout` seconds passed."""
    deadline = time.monotonic() + timeout
    while agent.poll() is None and time.monotonic() < deadline:
        if _start_lines(log) > lines_before:
            return True
        time.sleep(0.02)
    return False


def _start_lines(log: Path) -> int:
    return len(START_LINE.findall(log.read_text())) if log.exists() else 0


def _wait_for_group(agent: subprocess.Popen, old_pids: set[int], timeout: float = 120) -> dict[int, int] | None:
    """The {rank: pid} of a complete group of 2 workers other than `old_pids`; None if torchrun ended."""
    deadline = time.monotonic() + timeout
    while agent.poll() is None and time.monotonic() < deadline:
        group = worker_pids(agent.pid)
        if len(group) == 2 and not set(group.values()) & old_pids:
            return group
        time.sleep(0.02)
    return None


def same_run(run_dir: Path, reference: Path) -> bool:
    """Bitwise equal final weights and metrics.json (timings aside)."""
    import torch

    def load(directory: Path) -> tuple[dict, dict]:
        saved = torch.load(directory / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
        return saved["models"]["model"], _without_timing(json.loads((directory / "metrics.json").read_text()))

    try:
        (weights, summary), (expected_weights, expected) = load(run_dir), load(reference)
    except (OSError, KeyError, ValueError):
        return False
    return summary == expected and weights.keys() == expected_weights.keys() and all(
        torch.equal(weights[name], expected_weights[name]) for name in weights)


def measure_phases(reference: Path, workdir: Path, epochs: int) -> Phases:
    """Run the uninterrupted run, timing its start-up (to the log line written right before the first step)
    and its training."""
    started = time.time()
    subprocess.run(torchrun(0, reference, epochs), cwd=workdir, check=True, capture_output=True)
    log = (reference / "train.log").read_text()
    first_step = _stamp(START_LINE.search(log).group(1))
    last_line = _stamp(re.findall(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]", log, re.M)[-1])
    return Phases(startup_s=first_step - started, training_s=last_line - first_step)


def _stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _without_timing(summary: dict) -> dict:
    history = [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in summary["history"]]
    return {**{k: v for k, v in summary.items() if k not in TIMING_KEYS}, "history": history}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="trial i uses seed SEED+i")
    parser.add_argument("--kills", type=int, default=3, help="workers killed per trial")
    parser.add_argument("--max-restarts", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=8, help="of digits, each run (22 steps an epoch)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    reference = workdir / "uninterrupted"
    phases = measure_phases(reference, workdir, args.epochs)
    trials = [run_trial(args.seed + i, workdir, args.kills, args.max_restarts, phases, reference, args.epochs)
              for i in range(args.trials)]
    print("| seed | kills | resumes | steps redone | seconds | exit | bitwise equal |\n|---|---|---|---|---|---|---|")
    for t in trials:
        print(f"| {t.seed} | {t.kills} | {t.resumes} | {t.redone} | {t.seconds:.1f} | {t.returncode} | {t.equal} |")
    kills, redone = sum(t.kills for t in trials), sum(t.redone for t in trials)
    print(f"{sum(t.equal for t in trials)}/{len(trials)} trials equal to the uninterrupted run; {kills} kills, "
          f"{redone} steps redone ({redone / max(kills, 1):.1f} per kill; checkpoints every 7 steps) "
          f"(start-up {phases.startup_s:.1f} s, training {phases.training_s:.1f} s; runs in {workdir})")
    return 0 if all(t.equal for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
