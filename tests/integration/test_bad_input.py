"""Every way a user can get a run wrong ends the same way: exit code 2, ONE `error:` line on stderr
naming what to change, no traceback, and no existing run's files touched.

The rows run the real command line from a directory whose outputs/ already holds a finished run,
as a user's would. Of Hydra's composition errors, five run here (an unknown option, a mistyped key, a wrong type,
an unparsable override, eval.py's unknown option): they share one path to the `error:` line. The wording of every
case (a key one level down, a key of an option not chosen, each type, eval.py's groups, ...) is checked in process
by tests/unit/config/test_hydra_errors.py, which composes the same conf/ through the same code.
"""

from __future__ import annotations

import hashlib
import socket
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch
from conftest import REPO, TRAIN, copy_run, run, torchrun

pytestmark = pytest.mark.slow

EVAL = str(REPO / "eval.py")
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU this machine has")


def options(group: str) -> str:
    """The options of a config group, as an error line lists them: from conf/, so a fork's own YAMLs join them."""
    return ", ".join(sorted(path.stem for path in (REPO / "conf" / group).glob("*.yaml")))


def row(script: str, args: list[str], message: str, id: str, marks=()):  # noqa: A002 - pytest's name
    return pytest.param(script, args, message, id=id, marks=marks)


ROWS = [
    # Hydra's composition: the command line against conf/ and the schema's types (every wording:
    # tests/unit/config/test_hydra_errors.py).
    row(TRAIN, ["model=cnnn"], "model=cnnn is not an option of model (did you mean model=cnn?); "
        f"choose one of {options('model')}", "unknown-option"),
    row(TRAIN, ["trainer.epoch=3"], "trainer.epoch is not a config key (did you mean trainer.epochs?)", "typo-in-key"),
    row(TRAIN, ["trainer.epochs=abc"], "trainer.epochs=abc: trainer.epochs takes an integer, e.g. trainer.epochs=20",
        "int-expected"),
    row(TRAIN, ["trainer.epochs=[1"], "cannot parse the override 'trainer.epochs=[1'", "unparsable-override"),
    row(EVAL, ["checkpoint={checkpoint}", "dataset=nope"], "dataset=nope is not an option of dataset",
        "eval-unknown-option"),
    row(TRAIN, ["optimizer=null"], "the config does not compose (Config group override must be a string or a list. "
        "Got NoneType); to leave a config group out of this run: ~GROUP, e.g. ~optimizer", "group-set-to-null"),
    # Values the types let through, refused when the run starts (src/config/schema.py): two rows here, as they
    # share one path to the `error:` line; the wording of every value the schema refuses is checked in process
    # by tests/unit/config/test_schema.py.
    row(TRAIN, ["trainer.epochs=0", "trainer.keep_last=0", "dataset.batch_size=abc", "+trainer.epoch=3"],
        "trainer.epoch is not a setting (did you mean trainer.epochs?): nothing reads it; remove it; trainer.epochs=0 "
        "must be at least 1; trainer.keep_last=0 must be at least 1; dataset.batch_size=abc must be a positive whole "
        "number", "zero-epochs-keep-last-a-batch-size-of-abc-and-an-added-trainer-key"),
    row(TRAIN, ["dataset=image_folder"], "dataset.root is required: add dataset.root=VALUE", "required-key"),
    # Under a preset with a run dir of its own (debug=fast): OmegaConf made the default's run dir as it merged the
    # preset's onto it (src/parallel/job.py); the refused run leaves neither behind.
    row(TRAIN, ["debug=fast", "trainer.epochs=0"], "trainer.epochs=0 must be at least 1",
        "refused-under-a-preset-with-its-own-run-dir"),
    # A ${KEY} naming no key: a typo, resolved by the check above; or a fork's task YAML without the monitor that
    # trainer.monitor interpolates, resolved earlier, by Hydra's callbacks (the sweep summary names trainer.monitor).
    row(TRAIN, ["model.hidden=${{nope}}"], "model.hidden: Interpolation key 'nope' not found: set that key in its "
        "YAML or with +KEY=VALUE", "interpolation-of-no-key"),
    row(TRAIN, ["~task.monitor"], "the config: Interpolation key 'task.monitor' not found: set that key in its YAML "
        "or with +KEY=VALUE", "task-yaml-without-monitor"),
    # A model config reading a key of another group's option (a GAN generator's ${task.latent_size}): the choice named.
    row(TRAIN, ["model=gan_mlp"], "model.generator.in_features: Interpolation key 'task.latent_size' not found: "
        "task=classification does not set it: choose a task that does, or add +task.latent_size=VALUE",
        "model-reading-another-task-s-key"),
    # Callbacks' settings (conf/callbacks/), refused by the callback (src/config/building.py names the key); each
    # callback's other values (early_stopping.patience=0 ...) in process: tests/unit/callbacks/test_ema.py,
    # tests/unit/config/test_building.py; a task's own refusal (task.loss=huber) takes this path too: test_tasks.py.
    row(TRAIN, ["callbacks.ema.decay=1.5"], "callbacks.ema.decay=1.5 must be in (0, 1) (or null)",
        "ema-decay-above-1"),
    # A key the class does not take: the compose-time hint says so, and adding it anyway is one line too.
    row(TRAIN, ["+model.foo=1"], "model.foo is not an argument of model: src.components.models.SimpleCNN takes "
        "in_channels, image_size, num_outputs, channels, hidden, dropout; remove it", "model-argument-unknown"),
    row(TRAIN, ["model._target_=src.components.models.SimpleCNNN"], "model._target_=src.components.models.SimpleCNNN: "
        "module src.components.models has no SimpleCNNN; did you mean src.components.models.SimpleCNN?",
        "target-misspelt"),  # the other ways a target does not import: tests/unit/config/test_building.py
    row(TRAIN, ["+callbacks.mine._target_=src.callbacks.ema.EMA"], "callbacks.mine needs decay, warmup_steps: "
        "src.callbacks.ema.EMA takes decay, warmup_steps, model; add +callbacks.mine.decay=VALUE",
        "callback-argument-missing"),
    row(EVAL, ["checkpoint={checkpoint}", "weights=best"], "weights=best is not one of model, ema",
        "eval-unknown-weights"),
    # What the run finds when it starts: batches, files, devices, ports (a batch size of 0: the schema's, above; the
    # sampler's own check, in process, in tests/unit/data/test_data.py).
    row(TRAIN, ["trainer.grad_accum=3"], "must be divisible by world_size x trainer.grad_accum", "grad-accum"),
    # The workers of dist.nproc_per_node find it: their one line, then exit 2 and no run dir, as in one process.
    row(TRAIN, ["dataset.batch_size=63", "dist.nproc_per_node=2"], "dataset.batch_size=63 is the global batch and "
        "must be divisible by world_size x trainer.grad_accum = 2 x 1 = 2", "batch-size-over-two-workers"),
    row(TRAIN, ["dataset=mnist", "dataset.root=nowhere", "dataset.download=false"],
        "in nowhere/MNIST/raw, or set dataset.download=true", "missing-dataset-dir"),
    row(TRAIN, ["dataset=image_folder", "dataset.root={images}"], "image folder {images}/train is empty",
        "empty-image-folder"),
    # A run dir Hydra cannot make: train.py's callback says so first (tests/unit/parallel/test_launch.py), eval.py's
    # line comes from the mkdir Hydra tried (other places that take no folder: tests/unit/config/test_hydra_errors.py).
    row(EVAL, ["checkpoint={checkpoint}", "hydra.run.dir=foo.pt/run"], "cannot write foo.pt/run (Not a directory): "
        "choose another hydra.run.dir (hydra.sweep.dir with -m)", "eval-run-dir-below-a-file"),
    row(TRAIN, ["resume=missing.pt"], "checkpoint missing.pt does not exist", "missing-checkpoint"),
    row(TRAIN, ["resume={checkpoint}", "model=mlp"], "does not fit this model (Missing key(s) in state_dict: ",
        "resume-another-model"),
    # Fine-tuning (src/loop/init_from.py): one path to the line for every file that gives no weights, strict or not
    # (each file's wording: tests/unit/loop/test_init_from.py); init_from with resume=PATH is the schema's, above.
    row(TRAIN, ["init_from=missing.pt"], "init_from=missing.pt does not exist", "init-from-missing"),
    row(TRAIN, ["init_from=foo.pt"], "init_from=foo.pt: none of its 1 keys matches a weight of the model (foo)",
        "init-from-no-matching-key"),
    row(TRAIN, ["trainer.freeze=[backbone]"], "trainer.freeze: no parameter name starts with backbone; the model's "
        "parameter names start with classifier, features", "freeze-matches-nothing"),
    row(TRAIN, ["trainer.device=cuda"], "trainer.device=cuda but no CUDA GPU is visible", "cuda-absent",
        marks=NO_GPU),
    row(TRAIN, ["dist.nproc_per_node=2", "dist.backend=nccl"], "dist.backend=nccl needs CUDA devices; "
        "use dist.backend=gloo", "nccl-on-cpu", marks=NO_GPU),
    # (nccl in one process: `process_group` (src/parallel/distributed.py) calls `select_backend` before its
    # world-size branch, so the one-process eval-nccl-on-cpu row below takes train.py's path too; the message
    # is checked in tests/unit/parallel/test_distributed.py)
    row(EVAL, ["checkpoint={checkpoint}", "dist.backend=nccl"], "dist.backend=nccl needs CUDA devices; "
        "use dist.backend=gloo", "eval-nccl-on-cpu", marks=NO_GPU),
    row(TRAIN, ["dist.nproc_per_node=2", "dist.master_port={busy_port}"], "dist.master_port={busy_port} is in use "
        "on localhost; pick another port or leave dist.master_port=null", "port-in-use"),
    # A task that does not fit the dataset, or a metric it does not compute: both sides named (task=binary and
    # task=regression on digits: tests/unit/loop/test_task.py; val_ema/acc without EMA: tests/unit/callbacks/test_ema.py).
    row(TRAIN, ["task=classification", "dataset=diabetes", "model=mlp"], "task=classification needs class labels "
        "(num_classes), but dataset=diabetes provides num_features=10, num_targets=1", "classification-on-regression"),
    row(EVAL, ["checkpoint={checkpoint}", "dataset=diabetes"], "the checkpoint's task "
        "(src.components.tasks.Classification) needs class labels (num_classes), but dataset=diabetes provides "
        "num_features=10, num_targets=1", "eval-dataset-the-checkpoint-s-task-does-not-fit"),  # wording: test_task.py
    row(TRAIN, ["task=regression", "dataset=diabetes", "model=mlp", "trainer.monitor=val/f1"],
        "trainer.monitor=val/f1 is not a metric of task=regression; choose one of val/loss, val/mae, val/rmse, val/r2, "
        "train/loss", "monitor-the-task-lacks"),
    row(EVAL, ["checkpoint={checkpoint}", "weights=ema"], "{checkpoint} holds no EMA weights (its run had "
        "callbacks.ema.decay=null): evaluate its model with weights=model", "eval-ema-weights-absent"),
    row(TRAIN, ["task=regression", "dataset=diabetes"], "model.in_channels asks for the dataset's in_channels, which "
        "dataset=diabetes does not provide (it provides num_features=10, num_targets=1",
        "model-field-the-dataset-lacks"),
    # The task's inputs and target against the dataset's fields and the model's forward (src/loop/task_and_model.py).
    row(TRAIN, ["task.target=labl"], "task.target names the field 'labl', which dataset=digits does not have: its "
        "fields are image, label; set task.target to one of them", "field-the-dataset-lacks"),
    row(TRAIN, ["task=regression", "dataset=two_input_synthetic"], "SimpleCNN.forward(x) cannot take the task's "
        "inputs model(rgb, mask) (too many positional arguments) from dataset=two_input_synthetic's fields rgb, "
        "mask, target (target: target): set task.inputs=[FIELD,...] to the fields it takes",
        "input-the-model-does-not-take"),
]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` with a digest of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def workdir_with_a_run(one_epoch_run: Path, tmp_path_factory) -> tuple[Path, Path]:
    """A launch directory whose outputs/ holds one finished run (1 epoch of digits): (workdir, run dir)."""
    workdir = tmp_path_factory.mktemp("bad_input")
    run_dir = copy_run(one_epoch_run, workdir / "outputs" / "2026-01-01" / "00-00-00")
    (workdir / "images" / "train").mkdir(parents=True)
    (workdir / "images" / "val").mkdir()
    torch.save({"foo": torch.zeros(3)}, workdir / "foo.pt")  # init_from's row: a file with no model weights
    return workdir, run_dir


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    """A port of localhost that another server listens on."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


@pytest.mark.parametrize("script,args,message", ROWS)
def test_bad_input_is_one_clear_error(workdir_with_a_run, busy_port, script, args, message):
    workdir, run_dir = workdir_with_a_run
    values = {"checkpoint": run_dir / "checkpoints" / "last.pt", "images": workdir / "images", "busy_port": busy_port}
    before = snapshot(run_dir)
    checkpoints_before = sorted(workdir.rglob("*.pt"))
    run_dirs_before = run_dirs(workdir)

    result = run([sys.executable, script, *(arg.format(**values) for arg in args)], workdir)

    assert result.returncode == 2, result.stderr[-3000:]
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, result.stderr[-3000:]
    assert message.format(**values) in error_lines[0]
    assert "Traceback" not in result.stderr
    assert snapshot(run_dir) == before
    assert sorted(workdir.rglob("*.pt")) == checkpoints_before
    if script == TRAIN:  # a refused training run leaves no run dir of its own behind
        assert run_dirs(workdir) == run_dirs_before


def run_dirs(workdir: Path) -> list[Path]:
    """The training run dirs under workdir/outputs (DATE/TIME; eval.py's are under outputs/eval/)."""
    return sorted(p for p in workdir.glob("outputs/*/*") if p.parent.name != "eval")


def test_hydra_full_error_shows_hydras_traceback(tmp_path: Path):
    result = run([sys.executable, TRAIN, "model=cnnn"], tmp_path, env={"HYDRA_FULL_ERROR": "1"})
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "hydra.errors.MissingConfigException" in result.stderr
    assert "error:" not in result.stderr


def test_errors_of_the_run_itself_keep_hydras_report(tmp_path: Path):
    # Not a usage error: a well-typed model option the model class cannot build (a negative input width: torch's
    # RuntimeError; a wrongly typed argument is one line: tests/unit/config/test_building.py). Hydra reports it.
    result = run([sys.executable, TRAIN, "model.in_channels=-1", "hydra.run.dir=run"], tmp_path)
    assert result.returncode == 1
    assert "Error in call to target 'src.components.models.SimpleCNN'" in result.stderr
    assert "Set the environment variable HYDRA_FULL_ERROR=1" in result.stderr


TORCHRUN_ROWS = [
    pytest.param(TRAIN, ["dist.backend=nccl"], "dist.backend=nccl needs CUDA devices", id="train-nccl-on-cpu",
                 marks=NO_GPU),
    pytest.param(EVAL, ["checkpoint=missing.pt"], "checkpoint missing.pt does not exist", id="eval-missing-checkpoint"),
    # Every rank reads init_from; the group agrees on the failure and rank 0 alone reports it.
    pytest.param(TRAIN, ["init_from=missing.pt"], "init_from=missing.pt does not exist", id="train-init-from-missing"),
    # FSDP2 pins host memory to offload to; a CPU run has nothing to offload from (checked when sharding).
    pytest.param(TRAIN, ["dist=fsdp", "dist.fsdp.cpu_offload=true"], "dist.fsdp.cpu_offload=true moves the shards "
                 "between host memory and a GPU", id="train-fsdp-cpu-offload-on-cpu", marks=NO_GPU),
]


@pytest.mark.parametrize("script,args,message", TORCHRUN_ROWS)
def test_a_usage_error_under_torchrun_is_one_line_without_a_traceback(tmp_path: Path, script, args, message):
    """torch's @record would put the worker's traceback into torchrun's failure summary;
    a usage error bypasses it, so only torchrun's own report of the exit codes remains."""
    result = torchrun(2, [*args, "hydra.run.dir=run"], tmp_path, script=script)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    error_lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and message in error_lines[0], output[-3000:]
    assert "UsageError" not in output, output[-3000:]
    ours = (f'File "{REPO}/src/', f'File "{REPO}/train.py"', f'File "{REPO}/eval.py"')
    template_frames = [line for line in output.splitlines() if any(frame in line for frame in ours)]
    assert template_frames == [], output[-3000:]
    assert "exitcode  : 2" in output  # torchrun's own summary: the worker's usage-error exit code
