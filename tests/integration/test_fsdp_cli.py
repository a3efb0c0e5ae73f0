"""dist=fsdp through the real command line (torchrun, CPU, gloo): FSDP2 trains what DDP trains, its sharded
checkpoints (torch.distributed.checkpoint directories) resume bitwise on the same world size and reshard
to others, survive a kill in the middle of a save, load into DDP runs and back, evaluate and export.

Every run is launched at most once per module, on first use, and shared by the tests that read it.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, TRAIN, check, metrics, run, torchrun, weights
from faults import TORCHRUN, descendants, wait_until
from lazy_runs import LazyRuns

from src import checkpoint

pytestmark = pytest.mark.slow

EVAL = str(REPO / "eval.py")
# SGD with a constant LR (FACTS.md: Adam turns 1e-7 into 1e-2), sync-BN on (the default).
CNN = ["model=cnn", "optimizer=sgd", "scheduler=constant", "trainer.epochs=1", "dataset.batch_size=64"]
# No BatchNorm; 2 micro-steps per optimizer step and a clip far below the gradient's norm, so every step is
# clipped: a norm computed over one rank's shards only would scale the steps differently from DDP's.
MLP = ["model=mlp", "optimizer=sgd", "scheduler=constant", "trainer.epochs=1", "dataset.batch_size=64",
       "trainer.grad_accum=2", "trainer.grad_clip=0.01"]
# torch's fused SGD takes no sharded parameters, which take the foreach kernels instead (src/loop/optim.py),
# rounding differently: over 58 SGD steps by up to 9.4e-5 (measured here). DDP runs given the same kernels
# train the very same weights as FSDP (bit for bit, measured, without gradient clipping).
SAME_KERNELS = ["optimizer.fused=null", "+optimizer.foreach=true"]
# The default optimizer, AdamW, whose fused kernel takes sharded parameters: the same kernel on both sides. On CPU
# that kernel rounds a tensor's last (length mod 8) elements, its scalar tail, differently from its 8-wide body
# (tests/unit/loop/test_optim.py), so a tensor is updated bit for bit as DDP's whole one only if each shard but the
# last holds a multiple of 8 elements: a 16-class head (bias 8 + 8 on 2 ranks), where digits' 10 classes (5 + 5)
# put DDP and FSDP 7.5e-9 apart after 8 steps, 8.9e-8 after 22 (measured 2026-11-25).
ADAMW = ["model=cnn", "trainer.epochs=1", "dataset=synthetic", "dataset.num_classes=16", "dataset.image_size=[8,8]",
         "dataset.num_train=1408", "dataset.num_val=256", "dataset.batch_size=64"]
# Two epochs of 29 steps with a step checkpoint every 5: a stop at step 27 is mid-epoch 1 (step 27 of 29),
# and 48 divides by 1, 2 and 3 ranks. A run resumed on another world size is compared 3 steps after the resume
# (step 30, past the epoch's end and its validation), while only rounding sets the difference: later, one step can
# turn 1e-7 into far more, as rounding moves a value across a ReLU's kink, and which step does depends on the CPU's
# kernels. Measured: resumed on 3 ranks, train/loss followed the straight run within 1e-7 for 3 steps, then one
# step (31) turned that into 3.6e-5, ending 2.1e-3 apart (from an earlier scheme's initial weights; AMD EPYC,
# 2026-11-25); test_ema_cli.py's runs (these, with EMA) resumed on 1 process were 1.2e-7 apart at step 30 and
# 5.7e-4 at step 35 (Intel Xeon, 2026-11-27).
# Every parameter is decayed (decay_norm_and_bias=true), from the CNN's constructor weights (its init_module
# replays them: src/components/models.py LayerDefaults): the trajectory those numbers were measured on.
# The digits CNN (151k parameters) is one unit by default (dist.fsdp.min_unit_params): PER_UNIT shards its
# two children as units of their own, the layout with the most collectives, which most runs below use; the
# bf16 run keeps the default layout (the root, plus BatchNorm units in fp32).
PER_UNIT = ["dist=fsdp", "dist.fsdp.min_unit_params=0"]
TWO_EPOCHS = ["model=cnn", "optimizer=sgd", "optimizer.lr=0.05", "optimizer.decay_norm_and_bias=true",
              "scheduler=constant", "trainer.epochs=2", "dataset.batch_size=48", "trainer.checkpoint_every_steps=5",
              *PER_UNIT]
STOPPED = [*TWO_EPOCHS, "trainer.max_steps=27"]
TIMING_KEYS = {"epoch_time_s", "samples_per_s"}

RUNS: dict[str, tuple[int, list[str]]] = {  # name: (processes, overrides)
    "ddp cnn": (2, [*CNN]),
    "fsdp cnn": (2, [*CNN, *PER_UNIT]),
    "ddp adamw": (2, [*ADAMW]),
    "fsdp adamw": (2, [*ADAMW, *PER_UNIT]),
    "ddp mlp": (2, [*MLP, *SAME_KERNELS]),
    "ddp cnn bf16": (2, [*CNN, "trainer.precision=bf16"]),
    "fsdp cnn bf16": (2, [*CNN, "trainer.precision=bf16", "dist=fsdp"]),
    "fsdp mlp": (2, [*MLP, *PER_UNIT]),
    "straight": (2, TWO_EPOCHS),
    "stopped on 2": (2, STOPPED),
    "straight to step 30": (2, [*TWO_EPOCHS, "trainer.max_steps=30"]),
    "stopped on 1": (1, STOPPED),
    "ddp stopped": (2, [*STOPPED, "dist=ddp", *SAME_KERNELS]),
    # One epoch's checkpoints, written in the foreground and in the background, for the full-disk test to resume.
    "one epoch sync": (2, ["dist=fsdp", "trainer.progress=false", "trainer.epochs=1"]),
    "one epoch async_checkpoint": (2, ["dist=fsdp", "trainer.progress=false", "trainer.async_checkpoint=true",
                                       "trainer.epochs=1"]),
}


class Runs(LazyRuns):
    """The runs of RUNS, launched on first use; and copies of them resumed on other world sizes."""

    def resumed(self, name: str, processes: int, extra: tuple[str, ...] = ()) -> Path:
        """A copy of run `name`'s dir, continued with `resume=auto` on `processes` ranks."""
        suffix = "".join(f"_{override.replace('=', '-').replace('+', '')}" for override in extra)
        run_dir = self.root / f"{name.replace(' ', '_')}_resumed_on_{processes}{suffix}"
        shutil.copytree(self(name), run_dir)
        self.launch(processes, [*TWO_EPOCHS, *extra, "resume=auto", f"hydra.run.dir={run_dir}"])
        return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("fsdp"), RUNS)


def sharded_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The whole model of a run's newest sharded checkpoint, gathered in this process."""
    return checkpoint.read(run_dir / "checkpoints" / "last").model_weights()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[name].double() - b[name].double()).abs().max().item() for name in a)


def without_timing(summary: dict) -> dict:
    history = [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in summary["history"]]
    return {**{k: v for k, v in summary.items() if k not in TIMING_KEYS}, "history": history}


def assert_bitwise_equal(run_dir: Path, reference: Path) -> None:
    assert without_timing(metrics(run_dir)) == without_timing(metrics(reference))
    ours, theirs = sharded_weights(run_dir), sharded_weights(reference)
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


def assert_close_to(run_dir: Path, reference: Path, run_weights: dict[str, torch.Tensor]) -> None:
    """Within 1e-5 of the reference: every tensor, and each epoch's train and val loss."""
    assert max_diff(run_weights, sharded_weights(reference)) < 1e-5
    for ours, theirs in zip(metrics(run_dir)["history"], metrics(reference)["history"], strict=True):
        assert ours["step"] == theirs["step"]
        assert ours["train/loss"] == pytest.approx(theirs["train/loss"], abs=1e-5)
        assert ours["val/loss"] == pytest.approx(theirs["val/loss"], abs=1e-5)


# -- FSDP trains what DDP trains ----------------------------------------------------------------


@pytest.mark.parametrize("model", ["cnn", "mlp"])
def test_fsdp_trains_the_ddp_model_with_the_same_metrics(runs: Runs, model: str):
    """cnn: sync-BN, DDP with its default fused SGD; mlp: grad_accum=2, every step clipped, the same kernels."""
    ddp, fsdp = runs(f"ddp {model}"), runs(f"fsdp {model}")
    ddp_weights, fsdp_weights = weights(ddp), sharded_weights(fsdp)
    if model == "cnn":  # sync-BN: the running statistics too
        assert any("running_var" in name for name in fsdp_weights)
        assert max_diff(ddp_weights, fsdp_weights) < 1e-5
    else:  # the clip's norm sums the shards' squares over ranks: rounding only (measured 1.1e-8)
        assert max_diff(ddp_weights, fsdp_weights) < 1e-6
    ddp_metrics, fsdp_metrics = metrics(ddp), metrics(fsdp)
    assert fsdp_metrics["step"] == ddp_metrics["step"] and fsdp_metrics["world_size"] == 2
    for key in ("train/loss", "train/acc", "val/loss", "val/acc"):
        assert fsdp_metrics[key] == pytest.approx(ddp_metrics[key], abs=1e-5), key
    assert fsdp_metrics["val/num_samples"] == ddp_metrics["val/num_samples"] == 180


def test_fsdp_runs_adamws_fused_kernel_and_trains_bit_for_bit_what_ddp_trains(runs: Runs):
    """The default AdamW keeps `fused: true` on sharded parameters (its kernel takes DTensors), SGD's falls back
    to foreach with a log line; with the same kernel on both sides, FSDP's weights and metrics are DDP's exactly."""
    assert "foreach kernels instead" in (runs("fsdp cnn") / "train.log").read_text()
    assert "foreach kernels instead" not in (runs("fsdp adamw") / "train.log").read_text()
    ddp, fsdp = runs("ddp adamw"), runs("fsdp adamw")
    ddp_weights, fsdp_weights = weights(ddp), sharded_weights(fsdp)
    assert ddp_weights.keys() == fsdp_weights.keys()
    assert all(torch.equal(ddp_weights[name], fsdp_weights[name]) for name in ddp_weights)
    ddp_metrics, fsdp_metrics = metrics(ddp), metrics(fsdp)
    for key in ("train/loss", "train/acc", "val/loss", "val/acc"):
        assert fsdp_metrics[key] == ddp_metrics[key], key
    assert fsdp_metrics["step"] == ddp_metrics["step"] == 22


def test_bf16_computes_in_bf16_and_trains_what_ddp_trains(runs: Runs):
    """trainer.precision=bf16: FSDP's parameters in bf16 for the compute (BatchNorm's kept in fp32), DDP's under
    autocast; both keep fp32 master weights."""
    ddp, fsdp = runs("ddp cnn bf16"), runs("fsdp cnn bf16")
    fsdp_weights = sharded_weights(fsdp)
    assert all(tensor.dtype in (torch.float32, torch.int64) for tensor in fsdp_weights.values())
    assert max_diff(weights(ddp), fsdp_weights) < 1e-2
    for key in ("train/loss", "val/loss"):
        assert metrics(fsdp)[key] == pytest.approx(metrics(ddp)[key], abs=1e-3), key
    assert metrics(fsdp)["val/loss"] != pytest.approx(metrics(runs("fsdp cnn"))["val/loss"], abs=1e-4)  # not fp32


def test_the_fsdp_run_writes_sharded_checkpoint_directories(runs: Runs):
    checkpoints = runs("fsdp cnn") / "checkpoints"
    assert (checkpoints / "last").read_text() == (checkpoints / "best").read_text() == "step_000000022"
    assert sorted(path.name for path in (checkpoints / "step_000000022").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"]
    assert not list(checkpoints.glob("*.pt")) and not list(checkpoints.glob("*.tmp"))
    state = torch.load(checkpoints / "step_000000022" / "state.pt", weights_only=True)  # never runs code
    assert "model" not in state and state["loop"]["step"] == 22 and state["config"]["dist"]["strategy"] == "fsdp"


# -- resume: bitwise on the same world size, resharded on others ------------------------------


def test_stopped_on_2_ranks_and_resumed_on_2_ends_bitwise_equal(runs: Runs):
    stopped = runs("stopped on 2") / "checkpoints"
    assert (stopped / "last").read_text() == "step_000000027"
    assert sorted(path.name for path in stopped.iterdir()) == ["last", "step_000000025", "step_000000027"]
    resumed = runs.resumed("stopped on 2", 2)
    assert "after epoch 0, step 27 (27 steps into epoch 1)" in (resumed / "train.log").read_text()
    assert_bitwise_equal(resumed, runs("straight"))


@pytest.mark.parametrize("processes", [1, 3])
def test_stopped_on_2_ranks_resumes_on_another_world_size(runs: Runs, processes: int):
    resumed = runs.resumed("stopped on 2", processes, ("trainer.max_steps=30",))  # 3 steps (TWO_EPOCHS)
    assert metrics(resumed)["world_size"] == processes
    assert (resumed / "checkpoints" / "last").read_text() == "step_000000030"
    assert_close_to(resumed, runs("straight to step 30"), sharded_weights(resumed))


def test_stopped_on_1_process_resumes_on_2_ranks(runs: Runs):
    assert (runs("stopped on 1") / "checkpoints" / "step_000000027" / "__0_0.distcp").is_file()
    resumed = runs.resumed("stopped on 1", 2, ("trainer.max_steps=30",))
    assert (resumed / "checkpoints" / "last").read_text() == "step_000000030"
    assert_close_to(resumed, runs("straight to step 30"), sharded_weights(resumed))


@pytest.mark.parametrize("mode", [[], ["trainer.async_checkpoint=true"]], ids=["sync", "async_checkpoint"])
def test_a_kill_during_a_save_leaves_the_previous_checkpoint_to_resume_from(runs: Runs, launched, tmp_path: Path,
                                                                            mode: list[str]):
    """Rank 0 stalls while writing the index of the second checkpoint (step 10), after every rank wrote its
    shards (with trainer.async_checkpoint: in the writer thread, while training goes on up to the next save,
    which waits for it); the whole group is SIGKILLed there."""
    marker = tmp_path / "stalled"
    worker = str(REPO / "tests" / "fixtures" / "stalled_save_worker.py")
    process = launched.start([*TORCHRUN, "--standalone", "--nproc_per_node=2", worker, *TWO_EPOCHS, *mode,
                              "hydra.run.dir=run"], tmp_path, env={"STALL_MARKER": str(marker)})
    wait_until(marker.exists, timeout=180, what="the stalled save")
    for pid in [process.pid, *descendants(process.pid)]:  # torchrun's workers run in sessions of their own
        os.kill(pid, signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    checkpoints = tmp_path / "run" / "checkpoints"
    half = checkpoints / "step_000000010.tmp"
    assert marker.read_text() == str(half)
    assert {"__0_0.distcp", "__1_0.distcp", "state.pt"} <= {path.name for path in half.iterdir()}
    assert not (half / ".metadata").exists() and (checkpoints / "last").read_text() == "step_000000005"

    # An index-less directory is never a checkpoint, under its final name too.
    half.rename(checkpoints / "step_000000010")
    refused = run([sys.executable, EVAL, f"checkpoint={checkpoints / 'step_000000010'}"], tmp_path)
    assert refused.returncode == 2
    assert f"error: checkpoint {checkpoints / 'step_000000010'} is incomplete (no .metadata" in refused.stderr

    check(torchrun(2, [*TWO_EPOCHS, "resume=auto", "hydra.run.dir=run"], tmp_path))
    log = (tmp_path / "run" / "train.log").read_text()
    assert "after epoch 0, step 5 (5 steps into epoch 1)" in log
    assert_bitwise_equal(tmp_path / "run", runs("straight"))


def test_a_rank_stalled_in_a_background_write_ends_the_group_within_the_step_timeout(launched, tmp_path: Path):
    """trainer.async_checkpoint: rank 0 stalls in the writer thread (the index of the second checkpoint, step 10,
    as above) while rank 1's writer waits for it in a collective of the writer's own group. That group waits
    dist.step_timeout_s, as the training's does after the first step (not dist.timeout_s, 30 min by default):
    the group ends within it, naming the write's collective and rank 0, and the previous checkpoint stays."""
    marker, step_timeout_s = tmp_path / "stalled", 4
    worker = str(REPO / "tests" / "fixtures" / "stalled_save_worker.py")
    process = launched.start([*TORCHRUN, "--standalone", "--nproc_per_node=2", worker, *TWO_EPOCHS,
                              "trainer.async_checkpoint=true", f"dist.step_timeout_s={step_timeout_s}",
                              "hydra.run.dir=run"], tmp_path, env={"STALL_MARKER": str(marker)})
    wait_until(marker.exists, timeout=180, what="the stalled save")
    assert process.wait(timeout=step_timeout_s + 60) != 0
    log = (tmp_path / "run" / "train.rank1.log").read_text()  # rank 0 is the stalled one
    assert re.search(rf"torch\.distributed\.\w+ \(src/checkpoint/sharded_store\.py:\d+ write\) timed out after "
                     rf"{step_timeout_s} s \(dist\.step_timeout_s\): rank 0 did not arrive", log), log[-2000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (checkpoints / "last").read_text() == "step_000000005" and (checkpoints / "step_000000005").is_dir()
    assert not (checkpoints / "step_000000010").exists()


@pytest.mark.parametrize("mode", [[], ["trainer.async_checkpoint=true"]], ids=["sync", "async_checkpoint"])
def test_a_disk_with_no_room_for_the_shards_is_one_line_and_keeps_the_previous_checkpoint(runs: Runs, tmp_path: Path,
                                                                                         mode: list[str]):
    """As tests/integration/test_full_disk.py, sharded: a 512 KiB file-size limit (EFBIG, ENOSPC's path) under
    which each rank's shard file of the digits CNN with AdamW (about 0.9 MB) cannot be written. Written in the
    background (async_checkpoint), the failure surfaces when the run ends, as the same one line. The run resumed
    is a copy of a 1-epoch run written in the same mode."""
    from test_full_disk import LIMIT, file_size_limit

    args = ["dist=fsdp", "trainer.progress=false", *mode]
    shutil.copytree(runs(f"one epoch {'async_checkpoint' if mode else 'sync'}"), tmp_path / "run")
    checkpoints = tmp_path / "run" / "checkpoints"
    before = {path.name: path.read_bytes() for path in (checkpoints / "step_000000022").iterdir()}
    result = subprocess.run([*TORCHRUN, "--standalone", "--nproc_per_node=2", TRAIN, *args, "trainer.epochs=2",
                             "resume=auto", "hydra.run.dir=run"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=file_size_limit)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "UsageError" not in output and "CheckpointException" not in output
    (error,) = [line for line in output.splitlines() if line.startswith("error:")]
    assert f"error: cannot write checkpoint {checkpoints / 'step_000000044.tmp'} (File too large): it needs" in error
    assert f"at most {LIMIT:,} bytes" in error and "the previous checkpoint is unchanged" in error
    assert (checkpoints / "last").read_text() == "step_000000022"
    assert {path.name: path.read_bytes() for path in (checkpoints / "step_000000022").iterdir()} == before


# -- dist=ddp checkpoints into fsdp runs, and back ----------------------------------------------


def test_a_ddp_checkpoint_resumes_as_an_fsdp_run(runs: Runs):
    assert (runs("ddp stopped") / "checkpoints" / "last.pt").is_file()
    resumed = runs.resumed("ddp stopped", 2)  # TWO_EPOCHS: dist=fsdp
    assert "checkpoints/last.pt after epoch 0, step 27" in (resumed / "train.log").read_text()
    assert_close_to(resumed, runs("straight"), sharded_weights(resumed))


def test_an_fsdp_checkpoint_resumes_as_a_ddp_run(runs: Runs):
    resumed = runs.resumed("stopped on 2", 2, ("dist=ddp", *SAME_KERNELS))
    assert_close_to(resumed, runs("straight"), weights(resumed))  # last.pt, by rank 0


# -- evaluation and export ------------------------------------------------------------------------


@pytest.mark.parametrize("processes", [1, 2])
def test_eval_reads_a_sharded_checkpoint(runs: Runs, tmp_path: Path, processes: int):
    straight = runs("straight")
    for checkpoint_name, split in (("last", "val"), ("best", "test")):  # the final test evaluated best's weights
        args = [f"checkpoint={straight / 'checkpoints' / checkpoint_name}", f"split={split}",
                f"hydra.run.dir=eval_{split}"]
        check(run([sys.executable, EVAL, *args], tmp_path) if processes == 1 else torchrun(2, args, tmp_path, EVAL))
        evaluated = metrics(tmp_path / f"eval_{split}")
        assert evaluated["world_size"] == processes and evaluated["num_samples"] == 180
        assert evaluated[f"{split}/acc"] == metrics(straight)[f"{split}/acc"]
        assert evaluated[f"{split}/loss"] == pytest.approx(metrics(straight)[f"{split}/loss"], abs=1e-6)


def test_the_export_loads_into_the_plain_model_with_the_runs_val_metrics(runs: Runs, tmp_path: Path):
    from safetensors.torch import load_file

    from src.components.models import SimpleCNN
    from src.components.tasks import Classification
    from src.data.loaders import build_splits, make_eval_loader
    from src.loop.trainer import evaluate

    straight = runs("straight")
    out = tmp_path / "model.safetensors"
    result = check(run([sys.executable, "-m", "src.loop.export", str(straight / "checkpoints" / "best"), str(out)],
                       REPO))
    assert f"wrote {out}: 16 tensors" in result.stdout
    model = SimpleCNN(in_channels=1, image_size=(8, 8), num_outputs=10)
    model.load_state_dict(load_file(out))  # strict: every key and shape of the plain module
    config = torch.load(straight / "checkpoints" / "step_000000058" / "state.pt", weights_only=True)["config"]
    from omegaconf import OmegaConf

    splits = build_splits(OmegaConf.create(config["dataset"]))
    loader, _ = make_eval_loader(splits.val, 48, 0, 1, torch.device("cpu"), 0, 0)
    val = evaluate(Classification(), {"model": model}, lambda split: (loader, 0), splits.info, torch.device("cpu"))
    best = max(metrics(straight)["history"], key=lambda record: record["val/acc"])
    assert val["acc"] == best["val/acc"] and val["count"] == 180
    assert val["loss"] == pytest.approx(best["val/loss"], abs=1e-6)


def test_a_crafted_index_is_refused_without_running_it(runs: Runs, tmp_path: Path):
    """DCP itself reads `.metadata` with pickle.load: here a pickle that would create a file."""
    shutil.copytree(runs("straight"), tmp_path / "run")
    sentinel = tmp_path / "pwned"

    class Crafted:
        def __reduce__(self):
            return (open, (str(sentinel), "w"))

    directory = tmp_path / "run" / "checkpoints" / "step_000000058"
    (directory / ".metadata").write_bytes(pickle.dumps(Crafted()))
    for command in ([sys.executable, EVAL, f"checkpoint={directory}"],
                    [sys.executable, "-m", "src.loop.export", str(directory), str(tmp_path / "out.safetensors")]):
        result = run(command, REPO)
        assert result.returncode == 2, result.stderr
        (error,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        # The callable the crafted pickle names: io.open (Python 3.11, 3.12), _io.open (3.13).
        assert re.search(r"has an index \(\.metadata\) that is not DCP's metadata \(UnpicklingError: _?io\.open\)",
                         error), error
    assert not sentinel.exists() and not (tmp_path / "out.safetensors").exists()
