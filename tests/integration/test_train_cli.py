"""The real command line, end to end: what lands in the run dir, on 1 and 2 processes."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, TINY, check, metrics, torchrun, train
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from src.components.models import SimpleCNN

pytestmark = pytest.mark.slow


def only_run_dir(workdir: Path) -> Path:
    """The single run dir under workdir/outputs/DATE/TIME (fails if there are several)."""
    run_dirs = [p for p in (workdir / "outputs").glob("*/*") if p.is_dir()]
    assert len(run_dirs) == 1, f"expected one run dir, found {run_dirs}"
    return run_dirs[0]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> tuple[Path, str]:
    """`python train.py` with the default config for 2 epochs: its run dir and stdout."""
    workdir = tmp_path_factory.mktemp("default_run")
    result = check(train([*TINY], workdir))
    return only_run_dir(workdir), result.stdout


def hparams_of(events: EventAccumulator) -> dict[str, plugin_data_pb2.HParamsPluginData]:
    """The HParams plugin's records in a run's TensorBoard events, by tag."""
    return {tag: plugin_data_pb2.HParamsPluginData.FromString(content)
            for tag, content in events.PluginTagToContent("hparams").items()}


def test_single_process_run_dir_contract(default_run):
    run_dir, stdout = default_run
    result_stdout = stdout
    assert f"run dir: {run_dir.resolve()}" in result_stdout
    assert "final: train/loss=" in result_stdout
    # The console shows the overrides and the run-start line; the composed config is in the run dir and the log.
    assert f"[INFO] overrides: {' '.join(TINY)}\n" in result_stdout and "| world size 1 |" in result_stdout
    assert "config:" not in result_stdout and "[INFO] config:\ntask:\n" in (run_dir / "train.log").read_text()

    config = (run_dir / ".hydra" / "config.yaml").read_text()
    assert "_target_: src.components.models.SimpleCNN" in config and "epochs: 2" in config
    assert "final: train/loss=" in (run_dir / "train.log").read_text()

    summary = metrics(run_dir)
    assert summary["epoch"] == 2 and summary["step"] == 2 * (1437 // 64)
    assert summary["world_size"] == 1 and summary["val/num_samples"] == summary["test/num_samples"] == 180
    assert summary["samples_per_s"] > 0
    assert [h["epoch"] for h in summary["history"]] == [1, 2]
    assert summary["history"][-1]["val/acc"] == summary["val/acc"]
    assert summary["val/acc"] > 0.9 and summary["train/loss"] < summary["history"][0]["train/loss"]

    saved = torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert {"models", "optimizers", "schedulers", "loop", "config"} <= saved.keys()
    assert saved["output_model"] == "model" and set(saved["models"]) == set(saved["optimizers"]) == {"model"}
    assert {"epoch", "step"} <= saved["loop"].keys()
    assert saved["loop"]["epoch"] == 2 and saved["loop"]["step"] == summary["step"]
    assert saved["config"]["trainer"]["epochs"] == 2
    plain = SimpleCNN(in_channels=1, image_size=(8, 8), num_outputs=10)
    plain.load_state_dict(saved["models"]["model"])  # unwrapped: no DDP or compile prefixes
    best = torch.load(run_dir / "checkpoints" / "best.pt", map_location="cpu", weights_only=True)
    assert best["loop"]["epoch"] == max(summary["history"], key=lambda h: h["val/acc"])["epoch"]


def test_tensorboard_events_are_readable(default_run):
    run_dir, _ = default_run
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    for tag in ("train/loss", "train/acc", "val/loss", "val/acc", "lr", "throughput/samples_per_s", "time/epoch_s"):
        assert tag in scalars, f"{tag} missing from {scalars}"
    val_acc = events.Scalars("val/acc")
    assert [e.step for e in val_acc] == [22, 44]
    assert val_acc[-1].value == pytest.approx(metrics(run_dir)["val/acc"], abs=1e-6)
    assert [e.step for e in events.Scalars("train/loss")] == list(range(5, 45, 5))
    hparams = hparams_of(events)
    session = hparams["_hparams_/session_start_info"].session_start_info
    # What the command line set (TINY), then the chosen settings; not the ~40 constant config keys.
    assert set(session.hparams) == {"trainer.epochs", "trainer.log_every_steps", "task", "model", "dataset",
                                    "optimizer", "scheduler", "optimizer.lr", "seed", "global_batch_size"}
    assert session.hparams["optimizer.lr"].number_value == pytest.approx(0.003)
    assert session.hparams["model"].string_value == "cnn"
    assert session.hparams["trainer.log_every_steps"].number_value == 5
    assert session.hparams["global_batch_size"].number_value == 64
    metric_tags = {m.name.tag for m in hparams["_hparams_/experiment"].experiment.metric_infos}
    assert {"hparam/val/acc", "hparam/val/loss", "hparam/train/loss"} <= metric_tags
    assert events.Scalars("hparam/val/acc")[-1].value == pytest.approx(metrics(run_dir)["val/acc"], abs=1e-6)


def test_runs_started_in_the_same_second_write_a_run_dir_each(workdir: Path):
    """`for seed in 1 2; do python train.py seed=$seed & done`: both runs resolve outputs/DATE/HH-MM-SS alike (here
    forced: the same start time); the second to make it takes HH-MM-SS-2."""
    started = {"DDP_TEMPLATE_RUN_STARTED_AT": "2030-01-02T03:04:05"}
    args = ["trainer.epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda seed: train([*args, f"seed={seed}"], workdir, env=started), (1, 2)))
    day = workdir / "outputs" / "2030-01-02"
    assert sorted(path.name for path in day.iterdir()) == ["03-04-05", "03-04-05-2"]
    seeds = []
    for run_dir in day.iterdir():
        seed = int(yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())[-1].split("=")[1])
        saved = torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
        assert saved["config"]["seed"] == seed and metrics(run_dir)["step"] == 2  # the run's own files only
        assert len(list((run_dir / "tb").iterdir())) == 1 and (run_dir / "train.log").read_text().count("final:") == 1
        assert any(f"run dir: {run_dir.resolve()}" in check(result).stdout and f"seed={seed}" in result.stdout
                   for result in results)
        seeds.append(seed)
    assert sorted(seeds) == [1, 2]


def test_multirun_writes_one_dir_per_job(workdir: Path):
    check(train(["-m", "optimizer=sgd,adam", "trainer.epochs=1", "hydra.sweep.dir=sweep"], workdir))
    jobs = sorted(p for p in (workdir / "sweep").iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1"]
    job_optimizer = {"0": "sgd", "1": "adam"}
    optimizers = []
    for job in jobs:
        assert metrics(job)["epoch"] == 1
        assert (job / "checkpoints" / "last.pt").exists() and list((job / "tb").iterdir())
        saved = torch.load(job / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
        optimizers.append(saved["config"]["optimizer"]["_target_"])
        events = EventAccumulator(str(job / "tb"))
        events.Reload()
        session = hparams_of(events)["_hparams_/session_start_info"].session_start_info
        # The HParams table lines the jobs up by the key the sweep varies, named by option.
        assert session.hparams["optimizer"].string_value == job_optimizer[job.name]
        assert not [key for key in session.hparams if key.endswith(("_target_", "num_workers", "split_seed"))]
    assert optimizers == ["torch.optim.SGD", "torch.optim.Adam"]


def options(group: str) -> str:
    return ", ".join(sorted(path.stem for path in (REPO / "conf" / group).glob("*.yaml")))


def test_help_lists_groups_and_cfg_job_prints_the_config_without_a_run_dir(workdir: Path):
    help_text = check(train(["--help"], workdir)).stdout
    for group in ("model", "dataset", "task", "optimizer", "scheduler", "logger"):  # conf/'s, a fork's YAMLs too
        assert f"{group}: {options(group)}" in help_text
    result = check(train(["--cfg", "job"], workdir))
    assert "batch_size: 64" in result.stdout and "sync_bn: true" in result.stdout
    assert not (workdir / "outputs").exists()


def file_digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_batch_size_must_divide_over_ranks(workdir: Path):
    result = torchrun(2, ["dataset.batch_size=63", "hydra.run.dir=run"], workdir)
    assert result.returncode != 0
    assert "dataset.batch_size=63 is the global batch and must be divisible by world_size" in result.stderr
    assert not (workdir / "run" / "checkpoints").exists()


def test_an_existing_run_is_never_overwritten(default_run, workdir: Path):
    run_dir, _ = default_run
    before = file_digests(run_dir)
    result = train(["trainer.epochs=1", f"hydra.run.dir={run_dir}"], workdir)
    assert result.returncode == 2
    assert "already holds a run; pass resume=auto" in result.stderr
    assert file_digests(run_dir) == before  # refused before Hydra writes .hydra/ or a log line
