"""The three research recipes through the real command line (src/recipes/: each one class plus YAMLs and a preset),
held to the guarantees of the built-in supervised step:

- gan_digits (two models, two optimizers, its own step, noise drawn per sample): 1 process and 2 ranks agree within
  1e-5 after 3 steps; dist=fsdp trains bitwise what dist=ddp trains; a run stopped mid-epoch resumes bitwise, under
  dist=ddp and dist=fsdp; no monitored metric means no best.pt; a grid of samples lands in TensorBoard each epoch;
- distill_digits (a frozen auxiliary teacher, a loss that sees the whole batch): the checkpoint holds no teacher
  tensor, and a stopped run resumes bitwise;
- simclr_digits (two views per sample, NT-Xent over the global batch gathered with gradients, a kNN evaluation):
  2 ranks x B train what 1 process x 2B trains (within 1e-5), and so do 2 ranks accumulating 2 micro-batches of
  B/2 (the negatives are the global batch's, not a micro-batch's), and dist=fsdp bitwise as dist=ddp there; a
  stopped run resumes bitwise, accumulating or not; eval.py gives the same kNN accuracy on 1, 2 and 3 ranks.
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

from src import checkpoint

pytestmark = pytest.mark.slow

TIMING_KEYS = {"epoch_time_s", "samples_per_s"}
QUIET = ["trainer.progress=false"]
# 22 steps an epoch (1,437 images, batch 64): a stop at step 30 is step 8 of epoch 2.
GAN = ["experiment=gan_digits", "trainer.epochs=2", *QUIET]
GAN_STEPS = ["experiment=gan_digits", "trainer.max_steps=3", *QUIET]
# The teacher: the default CNN for 3 epochs (val/acc ~0.97).
TEACHER = ["experiment=digits_cnn", "trainer.epochs=3", *QUIET]
DISTILL = ["experiment=distill_digits", "trainer.epochs=2", *QUIET]
# 11 steps an epoch (batch 128): a stop at step 15 is step 4 of epoch 2. SGD for the 1-vs-2 comparison (Adam
# turns rounding into lr-sized steps: FACTS.md).
SIMCLR = ["experiment=simclr_digits", "trainer.epochs=2", *QUIET]
SIMCLR_SGD = ["experiment=simclr_digits", "trainer.max_steps=5", "optimizer=sgd", "optimizer.lr=0.05",
              "scheduler=constant", "trainer.log_every_steps=5", *QUIET]

RUNS: dict[str, tuple[int, list[str]]] = {
    "gan steps on 1": (1, GAN_STEPS),
    "gan steps on 2": (2, GAN_STEPS),
    "gan steps fsdp on 2": (2, [*GAN_STEPS, "dist=fsdp"]),
    "gan": (1, GAN),
    "gan fsdp": (2, [*GAN, "dist=fsdp"]),
    "teacher": (1, TEACHER),
    "simclr": (1, SIMCLR),
    "simclr sgd on 1": (1, SIMCLR_SGD),
    "simclr sgd on 2": (2, SIMCLR_SGD),
    "simclr sgd accumulated on 2": (2, [*SIMCLR_SGD, "trainer.grad_accum=2"]),
    "simclr sgd accumulated fsdp on 2": (2, [*SIMCLR_SGD, "trainer.grad_accum=2", "dist=fsdp"]),
    "simclr accumulated": (1, [*SIMCLR, "trainer.grad_accum=2"]),
    # Stopped mid-epoch, to resume (a copy) with resume=auto: gan's step 30 is step 8 of epoch 2, simclr's 15 step 4.
    "gan stopped": (1, [*GAN, "dist=ddp", "trainer.max_steps=30"]),
    "gan fsdp stopped": (2, [*GAN, "dist=fsdp", "trainer.max_steps=30"]),
    "simclr stopped": (1, [*SIMCLR, "trainer.max_steps=15"]),
    "simclr accumulated stopped": (1, [*SIMCLR, "trainer.grad_accum=2", "trainer.max_steps=15"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> LazyRuns:
    return LazyRuns(tmp_path_factory.mktemp("recipes"), RUNS)


def last(run_dir: Path) -> Path:
    checkpoints = run_dir / "checkpoints"
    return checkpoints / "last.pt" if (checkpoints / "last.pt").exists() else checkpoints / "last"


def models(run_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every model's weights in the run's newest checkpoint, of either format, by model name."""
    saved = checkpoint.read(last(run_dir))
    return {name: saved.model_weights(name) for name in saved.model_names}


def max_diff(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]) -> float:
    assert a.keys() == b.keys()
    return max((a[m][k].double() - b[m][k].double()).abs().max().item() for m in a for k in a[m])


def without_timing(summary: dict) -> dict:
    history = [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in summary["history"]]
    return {**{k: v for k, v in summary.items() if k not in TIMING_KEYS}, "history": history}


def stopped_and_resumed(workdir: Path, args: list[str], stop_at: int) -> Path:
    """A 1-process run stopped after `stop_at` steps (a step checkpoint), then continued with resume=auto."""
    first = check(train([*args, f"trainer.max_steps={stop_at}", "hydra.run.dir=run"], workdir))
    assert f"stopped at step {stop_at} with a checkpoint" in first.stdout + first.stderr
    check(train([*args, "resume=auto", "hydra.run.dir=run"], workdir))
    return workdir / "run"


def resumed(runs: LazyRuns, stopped: str, workdir: Path, args: list[str], stop_at: int) -> Path:
    """A copy of run `stopped` (stopped after `stop_at` steps: a step checkpoint) in workdir/run, continued with
    resume=auto on as many processes (one: with 2 threads, as LazyRuns launches it and the references)."""
    processes, _ = runs.runs[stopped]
    assert f"stopped at step {stop_at} with a checkpoint" in (runs(stopped) / "train.log").read_text()
    run_dir = copy_run(runs(stopped), workdir / "run")
    extra = [*args, "resume=auto", f"hydra.run.dir={run_dir}"]
    check(train(extra, workdir, env=TWO_THREADS) if processes == 1 else torchrun(processes, extra, workdir))
    return run_dir


def assert_bitwise_equal(run_dir: Path, reference: Path) -> None:
    assert without_timing(metrics(run_dir)) == without_timing(metrics(reference))
    assert max_diff(models(run_dir), models(reference)) == 0


# -- gan_digits -----------------------------------------------------------------------------------------------


def test_gan_on_two_ranks_trains_what_one_process_trains_with_noise_drawn_per_sample(runs: LazyRuns):
    one, two = models(runs("gan steps on 1")), models(runs("gan steps on 2"))
    assert set(one) == {"generator", "discriminator"}
    difference = max_diff(one, two)
    print(f"gan_digits after 3 steps, 2 ranks vs 1 process: max |difference| {difference:.3g}")
    assert difference < 1e-5
    fresh = checkpoint.read(last(runs("gan steps on 1")))
    assert fresh.loop["step"] == 3 and set(fresh.state["optimizers"]) == {"generator", "discriminator"}


def test_gan_under_fsdp_trains_bitwise_what_ddp_trains(runs: LazyRuns):
    assert (runs("gan steps fsdp on 2") / "checkpoints" / "last").is_file()  # sharded: every optimizer's shards
    assert max_diff(models(runs("gan steps on 2")), models(runs("gan steps fsdp on 2"))) == 0
    assert metrics(runs("gan fsdp"))["world_size"] == 2


@pytest.mark.parametrize("processes, strategy", [(1, "ddp"), (2, "fsdp")])
def test_gan_stopped_mid_epoch_resumes_bitwise(runs: LazyRuns, tmp_path: Path, processes: int, strategy: str):
    reference = runs("gan") if strategy == "ddp" else runs("gan fsdp")
    run_dir = resumed(runs, "gan stopped" if strategy == "ddp" else "gan fsdp stopped", tmp_path,
                      [*GAN, f"dist={strategy}"], stop_at=30)
    assert "after epoch 1, step 30 (8 steps into epoch 2)" in (run_dir / "train.log").read_text()
    assert_bitwise_equal(run_dir, reference)


def test_gan_without_a_monitored_metric_keeps_no_best_checkpoint_and_shows_samples(runs: LazyRuns):
    run_dir = runs("gan")
    summary = metrics(run_dir)
    assert {"val/d_real_acc", "val/d_fake_acc", "train/g_loss", "train/d_loss"} <= summary.keys()
    assert "val/judge_confidence" not in summary  # no judge given
    assert not (run_dir / "checkpoints" / "best.pt").exists() and (run_dir / "checkpoints" / "last.pt").exists()
    assert "no best.pt: trainer.monitor=null" in (run_dir / "train.log").read_text()
    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"images": 0})
    events.Reload()
    assert [event.step for event in events.Images("val/samples")] == [22, 44]


def test_gan_with_a_judge_reports_its_confidence_on_samples_and_on_noise(runs: LazyRuns, tmp_path: Path):
    judge = runs("teacher") / "checkpoints" / "best.pt"
    check(train([*GAN_STEPS, "trainer.max_steps=null", "trainer.epochs=1", f"aux.judge.path={judge}",
                 "trainer.monitor=val/judge_confidence", "hydra.run.dir=run"], tmp_path))
    summary = metrics(tmp_path / "run")
    assert 0.1 <= summary["val/judge_confidence"] <= 1 and 0.1 <= summary["val/noise_confidence"] <= 1
    assert (tmp_path / "run" / "checkpoints" / "best.pt").exists()
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert set(saved["models"]) == {"generator", "discriminator"}  # the judge is not saved


# -- distill_digits -----------------------------------------------------------------------------------------------


def test_distill_keeps_the_teacher_out_of_the_checkpoint_and_resumes_bitwise(runs: LazyRuns, tmp_path: Path):
    teacher = runs("teacher") / "checkpoints" / "best.pt"
    args = [*DISTILL, f"aux.teacher.path={teacher}"]
    check(train([*args, "hydra.run.dir=straight"], tmp_path))
    straight = tmp_path / "straight"
    log = (straight / "train.log").read_text()
    assert f"aux.teacher: SimpleCNN from {teacher}, frozen" in log
    saved = torch.load(straight / "checkpoints" / "last.pt", weights_only=True)
    teacher_weights = torch.load(teacher, weights_only=True)["models"]["model"]
    assert set(saved["models"]) == {"model"} and set(saved["optimizers"]) == {"model"}
    student = saved["models"]["model"]
    assert all(key.startswith("net.") for key in student)  # the MLP's, none of the CNN's
    tensors = [t for part in saved.values() if isinstance(part, dict) for t in _tensors(part)]
    shapes = {tuple(t.shape) for t in teacher_weights.values() if t.dim() > 1}
    assert not any(tuple(t.shape) in shapes for t in tensors)  # no teacher tensor anywhere in the file
    (tmp_path / "resumed").mkdir()
    resumed = stopped_and_resumed(tmp_path / "resumed", args, stop_at=30)
    assert_bitwise_equal(resumed, straight)


def _tensors(state) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    values = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else []
    return [tensor for value in values for tensor in _tensors(value)]


def test_distill_without_its_teacher_is_one_line(tmp_path: Path):
    refused = train([*DISTILL, "hydra.run.dir=run"], tmp_path)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == "error: aux.teacher.path is required: add aux.teacher.path=VALUE"


# -- simclr_digits ------------------------------------------------------------------------------------------------


def test_simclr_on_two_ranks_trains_what_one_process_trains_over_the_global_batch(runs: LazyRuns):
    difference = max_diff(models(runs("simclr sgd on 1")), models(runs("simclr sgd on 2")))
    print(f"simclr_digits after 5 steps, 2 ranks x 64 vs 1 process x 128: max |difference| {difference:.3g}")
    assert difference < 1e-5


def test_simclr_accumulating_micro_batches_trains_what_one_step_of_the_global_batch_trains(runs: LazyRuns):
    """2 ranks x 2 micro-batches of 32 against 1 process x 128: each micro-batch's views are contrasted with every
    view of the global batch (gradient caching), so the weights and the logged train loss agree; contrasted with its
    own micro-batch only, the loss is lower (fewer negatives) and the weights move elsewhere."""
    one, accumulated = runs("simclr sgd on 1"), runs("simclr sgd accumulated on 2")
    difference = max_diff(models(one), models(accumulated))
    print(f"simclr_digits after 5 steps, 2 ranks x 2 x 32 vs 1 process x 128: max |difference| {difference:.3g}")
    assert difference < 1e-5
    losses = [EventAccumulator(str(run_dir / "tb")).Reload().Scalars("train/loss") for run_dir in (one, accumulated)]
    assert [event.step for event in losses[0]] == [event.step for event in losses[1]] == [5]
    assert losses[1][0].value == pytest.approx(losses[0][0].value, rel=1e-6)
    # dist=fsdp takes the same cached gradients through its sharded model: bitwise what dist=ddp trains.
    assert max_diff(models(accumulated), models(runs("simclr sgd accumulated fsdp on 2"))) == 0


@pytest.mark.parametrize("accumulation", [[], ["trainer.grad_accum=2"]], ids=["one step", "accumulated"])
def test_simclr_stopped_mid_epoch_resumes_bitwise(runs: LazyRuns, tmp_path: Path, accumulation: list[str]):
    run_dir = resumed(runs, "simclr accumulated stopped" if accumulation else "simclr stopped", tmp_path,
                      [*SIMCLR, *accumulation], stop_at=15)
    assert "after epoch 1, step 15 (4 steps into epoch 2)" in (run_dir / "train.log").read_text()
    assert_bitwise_equal(run_dir, runs("simclr accumulated" if accumulation else "simclr"))
    assert 0.5 < metrics(run_dir)["val/knn_acc"] <= 1


@pytest.mark.parametrize("processes", [1, 2, 3])
def test_simclr_knn_accuracy_is_exact_on_any_world_size_in_eval(runs: LazyRuns, tmp_path: Path, processes: int):
    trained = metrics(runs("simclr"))
    args = [f"checkpoint={last(runs('simclr'))}", "split=val", "hydra.run.dir=eval"]
    eval_py = str(REPO / "eval.py")
    command = [sys.executable, eval_py, *args] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", eval_py, *args]
    check(run(command, tmp_path))
    result = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert result["world_size"] == processes and result["num_samples"] == 180
    assert result["val/knn_acc"] == trained["val/knn_acc"]  # the same votes: counted once each, on any world size
    assert result["val/loss"] == pytest.approx(trained["val/loss"], abs=1e-5)


def test_the_readme_s_worked_example_is_the_recipe_s_own_step():
    import re

    readme = (REPO / "README.md").read_text()
    shown = next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S)
                 if block.lstrip().startswith("def train_step(self, step: StepContext)"))
    assert shown in (REPO / "src" / "recipes" / "gan.py").read_text()
