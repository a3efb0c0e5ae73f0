"""EMA weights end to end (callbacks.ema.decay): the real command line on 1 and 2 processes.

- 2 ranks at batch 32 each keep the EMA 1 process keeps at batch 64 (sync-BN, SGD: the settings of
  test_equivalence.py's sync-BN test);
- a run stopped mid-epoch and resumed ends with bitwise the EMA of an uninterrupted run;
- val_ema/<metric> is reported every epoch (history, metrics.json, log line, TensorBoard), can be
  monitored (best.pt), and `eval.py weights=ema` reproduces it.
The training runs the tests read are launched once per module (LazyRuns). The bad values (decay 1.5, 0;
weights=ema without EMA) are rows of test_bad_input.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, TWO_THREADS, check, copy_run, metrics, run, torchrun, train
from lazy_runs import LazyRuns
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.slow

EVAL = str(REPO / "eval.py")
TIMING_KEYS = {"epoch_time_s", "samples_per_s"}

# test_equivalence.py's sync-BN comparison (BatchNorm, SGD, constant LR, global batch 64, every parameter decayed:
# the trajectory its bound was measured on), with EMA.
CNN_EMA = ["model=cnn", "optimizer=sgd", "scheduler=constant", "trainer.epochs=1", "dataset.batch_size=64",
           "optimizer.decay_norm_and_bias=true", "dist.sync_bn=true", "callbacks.ema.decay=0.9"]
# test_fault_tolerance.py's resume runs, with EMA (and its warmup) monitored.
TWO_EPOCHS_EMA = ["trainer.epochs=2", "optimizer=sgd", "optimizer.lr=0.01", "scheduler=constant",
                  "callbacks.ema.decay=0.9", "callbacks.ema.warmup_steps=10", "trainer.monitor=val_ema/acc"]


def checkpoint(run_dir: Path, name: str = "last.pt") -> dict:
    """A checkpoint's parts, with the EMA callback's weights as `ema` and its state as `ema_state`."""
    saved = torch.load(run_dir / "checkpoints" / name, map_location="cpu", weights_only=True)
    ema = saved["callbacks"].get("ema", {})
    return {**saved, "model": saved["models"]["model"], **({"ema": ema["weights"], "ema_state": ema} if ema else {})}


def without_timing(summary: dict) -> dict:
    history = [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in summary["history"]]
    return {**{k: v for k, v in summary.items() if k not in TIMING_KEYS}, "history": history}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[name].double() - b[name].double()).abs().max().item() for name in a)


def test_two_ranks_keep_the_ema_of_one_process(runs: LazyRuns):
    one, two = checkpoint(runs("one")), checkpoint(runs("two"))
    assert one["ema"].keys() == one["model"].keys()
    assert any("running_var" in name for name in one["ema"])
    difference = max_diff(one["ema"], two["ema"])
    print(f"EMA weights, 2 ranks vs 1 process: max |difference| {difference:.3g}")
    assert difference <= 1e-5  # every tensor: weights, BN affine, running stats
    assert max_diff(one["ema"], one["model"]) > 1e-3  # an average, not a copy of the weights
    assert metrics(runs("two"))["val_ema/acc"] == pytest.approx(metrics(runs("one"))["val_ema/acc"], abs=2 / 180)


@pytest.fixture(scope="module")
def straight(runs: LazyRuns) -> Path:
    """One process, two epochs with EMA monitored, never interrupted."""
    return runs("straight")


def test_a_run_stopped_mid_epoch_resumes_to_bitwise_the_same_ema(tmp_path: Path, runs: LazyRuns, straight: Path):
    assert "stopped at step 27 with a checkpoint" in (runs("stopped") / "train.log").read_text()
    copy_run(runs("stopped"), tmp_path / "run")
    stopped = checkpoint(tmp_path / "run")
    loop = stopped["loop"]
    assert (loop["epoch"], loop["step"], loop["step_in_epoch"]) == (1, 27, 5) and "ema" in stopped
    check(train([*TWO_EPOCHS_EMA, "resume=auto", "hydra.run.dir=run"], tmp_path, env=TWO_THREADS))  # as LazyRuns
    resumed, reference = checkpoint(tmp_path / "run"), checkpoint(straight)
    for key in ("ema", "model"):
        for name, tensor in reference[key].items():
            assert torch.equal(tensor, resumed[key][name]), (key, name)
    assert without_timing(metrics(tmp_path / "run")) == without_timing(metrics(straight))


def test_val_ema_is_reported_every_epoch_and_picks_best(straight: Path):
    summary = metrics(straight)
    assert len(summary["history"]) == 2
    for record in summary["history"]:
        assert {"val_ema/loss", "val_ema/acc", "val/loss", "val/acc"} <= record.keys()
    assert summary["val_ema/acc"] == summary["history"][-1]["val_ema/acc"] > 0.5
    log = (straight / "train.log").read_text()
    assert log.count("  val_ema loss ") == 2  # one epoch line each
    events = EventAccumulator(str(straight / "tb"))
    events.Reload()
    assert [event.step for event in events.Scalars("val_ema/acc")] == [22, 44]
    best = checkpoint(straight, "best.pt")
    values = [record["val_ema/acc"] for record in summary["history"]]
    assert best["ema_state"]["best_weights"] == "ema" and best["loop"]["best"] == max(values)
    assert best["loop"]["epoch"] == 1 + values.index(max(values))


def evaluate(args: list[str], cwd: Path) -> dict:
    check(run([sys.executable, EVAL, *args, "hydra.run.dir=evaluated"], cwd))
    return json.loads((cwd / "evaluated" / "metrics.json").read_text())


def test_eval_of_the_ema_weights_reproduces_val_ema(straight: Path, tmp_path: Path):
    summary = metrics(straight)
    evaluated = evaluate([f"checkpoint={straight / 'checkpoints' / 'last.pt'}", "weights=ema", "split=val"], tmp_path)
    assert evaluated["weights"] == "ema" and evaluated["num_samples"] == 180
    assert evaluated["val/acc"] == summary["val_ema/acc"]
    assert evaluated["val/loss"] == pytest.approx(summary["val_ema/loss"], abs=1e-6)
    (tmp_path / "model").mkdir()
    model = evaluate([f"checkpoint={straight / 'checkpoints' / 'last.pt'}", "split=val"], tmp_path / "model")
    assert model["weights"] == "model" and model["val/loss"] == pytest.approx(summary["val/loss"], abs=1e-6)


# -- under dist=fsdp: the average sharded like the parameters ----------------------------------------------------

SAME_KERNELS = ["optimizer.fused=null", "+optimizer.foreach=true"]  # fused SGD takes no shards (test_fsdp_cli.py)
FSDP = ["dist=fsdp", "dist.fsdp.min_unit_params=0"]
# 29 steps an epoch at batch 48 (divides by 1, 2 and 3 ranks); a stop at step 27, mid-epoch 1 (test_fsdp_cli.py's
# TWO_EPOCHS, with EMA).
FSDP_EMA = ["model=cnn", "optimizer=sgd", "optimizer.lr=0.05", "scheduler=constant", "trainer.epochs=2",
            "dataset.batch_size=48", "trainer.checkpoint_every_steps=5", "callbacks.ema.decay=0.9",
            "trainer.monitor=val_ema/acc", "trainer.progress=false", *FSDP]


def sharded(run_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The model's and the EMA's whole weights in a run's newest sharded checkpoint."""
    from src import checkpoint as checkpoints

    saved = checkpoints.read(run_dir / "checkpoints" / "last")
    return {"model": saved.model_weights(), "ema": saved.model_weights(weights="ema")}


RUNS: dict[str, tuple[int, list[str]]] = {  # name: (processes, overrides)
    "one": (1, CNN_EMA),
    "two": (2, CNN_EMA),
    "straight": (1, [*TWO_EPOCHS_EMA]),
    "stopped": (1, [*TWO_EPOCHS_EMA, "trainer.checkpoint_every_steps=5", "trainer.max_steps=27"]),
    "ddp": (2, [*CNN_EMA, *SAME_KERNELS]),
    "fsdp": (2, [*CNN_EMA, *FSDP]),
    "fsdp straight": (2, FSDP_EMA),
    "fsdp stopped": (2, [*FSDP_EMA, "trainer.max_steps=27"]),
    "fsdp to step 30": (2, [*FSDP_EMA, "trainer.max_steps=30"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> LazyRuns:
    return LazyRuns(tmp_path_factory.mktemp("ema"), RUNS)


def test_fsdp_keeps_the_ema_ddp_keeps(runs: LazyRuns):
    ddp, fsdp = checkpoint(runs("ddp")), sharded(runs("fsdp"))
    assert (runs("fsdp") / "checkpoints" / "last").is_file()  # a sharded checkpoint: every rank's shards
    assert max_diff(ddp["ema"], fsdp["ema"]) <= 1e-5 and max_diff(ddp["model"], fsdp["model"]) <= 1e-5
    assert max_diff(fsdp["ema"], fsdp["model"]) > 1e-3  # an average, not a copy of the weights
    assert metrics(runs("fsdp"))["val_ema/acc"] == pytest.approx(metrics(runs("ddp"))["val_ema/acc"], abs=1 / 180)


@pytest.mark.parametrize("processes", [2, 1, 3])
def test_a_sharded_ema_resumes_bitwise_on_its_world_size_and_reshards_to_others(runs: LazyRuns, processes: int):
    """On 2 ranks, resumed to the end; on others, 3 steps past the resume (step 30, after epoch 1's end and
    validation), compared while only rounding sets the difference (test_fsdp_cli.py's TWO_EPOCHS says why)."""
    import shutil

    run_dir = runs.root / f"resumed_on_{processes}"
    shutil.copytree(runs("fsdp stopped"), run_dir)
    args = [*FSDP_EMA, "resume=auto", f"hydra.run.dir={run_dir}", *([] if processes == 2 else ["trainer.max_steps=30"])]
    check(train(args, runs.root, env=TWO_THREADS) if processes == 1 else torchrun(processes, args, runs.root))
    reference = runs("fsdp straight" if processes == 2 else "fsdp to step 30")
    resumed, straight = sharded(run_dir), sharded(reference)
    assert metrics(run_dir)["world_size"] == processes and metrics(run_dir)["step"] == metrics(reference)["step"]
    if processes == 2:
        assert max_diff(resumed["ema"], straight["ema"]) == 0 and max_diff(resumed["model"], straight["model"]) == 0
        assert without_timing(metrics(run_dir)) == without_timing(metrics(reference))
    else:  # as the model reshards: within 1e-5 (test_fsdp_cli.py)
        assert max_diff(resumed["ema"], straight["ema"]) <= 1e-5
        assert max_diff(resumed["model"], straight["model"]) <= 1e-5


def test_eval_of_a_sharded_checkpoint_s_ema_weights_reproduces_val_ema(runs: LazyRuns, tmp_path: Path):
    summary = metrics(runs("fsdp straight"))
    evaluated = evaluate([f"checkpoint={runs('fsdp straight') / 'checkpoints' / 'last'}", "weights=ema",
                          "split=val"], tmp_path)
    assert evaluated["weights"] == "ema" and evaluated["num_samples"] == 180
    assert evaluated["val/acc"] == summary["val_ema/acc"]
    assert evaluated["val/loss"] == pytest.approx(summary["val_ema/loss"], abs=1e-6)
