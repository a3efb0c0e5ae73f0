"""src/parallel/job.py, ranks.py, workers.py and src/reports/sweep_summary.py without training: run-dir
agreement, rank detection, cluster environments, sweep tables."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, free_port
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from src.common.errors import UsageError
from src.config import schema  # registers train_schema and eval_schema
from src.parallel import job, ranks, workers
from src.reports import sweep_summary
from src.sweeps import jobs

AGREE = """
import os, sys, time
sys.path.insert(0, {repo!r})
if os.environ["RANK"] == "1":
    time.sleep(1.5)  # rank 1 reaches Hydra late, as on a busy node
from src.parallel import distributed, job
print(job.run_started_at().isoformat(), job.fresh_dir({run_dir!r}))
store = distributed.rendezvous_store(distributed.read_env())
if os.environ["RANK"] == "1":
    store.set("seen", "1")
else:
    store.wait(["seen"])  # rank 0 hosts the store: stay until rank 1 has read it
"""


def test_ranks_agree_on_rank_zeros_start_time_and_run_dir(tmp_path: Path):
    (tmp_path / "03-04-05").mkdir()  # another run's: rank 0 makes 03-04-05-2, which rank 1 takes too
    port = str(free_port())
    processes = []
    for rank in ("0", "1"):
        env = {**os.environ, "RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        env.pop("DDP_TEMPLATE_RUN_STARTED_AT", None)
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        code = AGREE.format(repo=str(REPO), run_dir=str(tmp_path / "03-04-05"))
        processes.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True))
    stamps = [p.communicate(timeout=60)[0].strip() for p in processes]
    assert [p.returncode for p in processes] == [0, 0]
    assert stamps[0] == stamps[1] and stamps[0].endswith(f" {tmp_path / '03-04-05-2'}")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["03-04-05", "03-04-05-2"]


def test_a_submitit_jobs_ranks_meet_on_the_port_rank_zero_publishes_not_a_busy_or_stale_one(tmp_path: Path):
    # submitit's MASTER_PORT is busy (a foreign store listens there) and the port file is an earlier start's,
    # naming that same foreign store: rank 1, started first, must wait for rank 0's file, not join the stranger.
    foreign = torch_store_on_a_free_port()
    port_file = tmp_path / "4242_master_port"
    port_file.write_text(f"{foreign.port} an-earlier-starts-token")
    processes = []
    for rank in ("1", "0"):
        env = {**os.environ, "RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(foreign.port), ranks.PORT_FILE: str(port_file)}
        env.pop("DDP_TEMPLATE_RUN_STARTED_AT", None)
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        code = AGREE.format(repo=str(REPO), run_dir=str(tmp_path / "run"))
        processes.append(subprocess.Popen([sys.executable, "-c", code], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        time.sleep(1.0)
    outputs = [p.communicate(timeout=60) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], [err[-2000:] for _, err in outputs]
    assert outputs[0][0] == outputs[1][0]  # one store: the start time rank 0 set
    published_port, token = port_file.read_text().split()
    assert int(published_port) != foreign.port and token != "an-earlier-starts-token"


def test_a_rank_that_finds_no_store_at_the_published_port_stops_naming_the_file_and_the_cause(tmp_path: Path):
    from src.parallel import distributed

    port_file = tmp_path / "4242_master_port"
    port_file.write_text("1 a-token")  # port 1: nothing of rank 0's listens there
    expected = f"rank 1: no store of rank 0's at the port in {port_file} within 1 s"
    with pytest.raises(TimeoutError, match=re.escape(expected)) as raised:
        distributed._published_store(ranks.DistEnv(rank=1, local_rank=1, world_size=2), port_file, 1.0)
    assert "127.0.0.1, 1" in str(raised.value.__cause__)  # the last connection that failed


def torch_store_on_a_free_port():
    import datetime

    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)


def test_start_time_is_inherited_by_child_processes(monkeypatch):
    monkeypatch.setenv("DDP_TEMPLATE_RUN_STARTED_AT", "2030-01-02T03:04:05")
    assert job.run_started_at().strftime("%Y-%m-%d/%H-%M-%S") == "2030-01-02/03-04-05"
    monkeypatch.delenv("DDP_TEMPLATE_RUN_STARTED_AT")
    stamp = job.run_started_at()
    assert os.environ["DDP_TEMPLATE_RUN_STARTED_AT"] == stamp.isoformat()
    assert job.run_started_at() == stamp  # agreed once: every later resolution reads it


def test_runs_started_in_the_same_second_take_a_dir_each(tmp_path: Path):
    path = str(tmp_path / "outputs" / "03-04-05")
    first, second, third = {}, {}, {}  # three runs' environments
    assert job.fresh_dir(path, first) == path and job.fresh_dir(path, second) == f"{path}-2"
    assert job.fresh_dir(path, first) == path  # asked again (Hydra resolves the dir more than once)
    assert job.fresh_dir(path, dict(second)) == f"{path}-2"  # by a process the run started
    assert job.fresh_dir(path, third) == f"{path}-3"
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["03-04-05", "03-04-05-2", "03-04-05-3"]
    srun_task = {"SLURM_NTASKS": "2", "SLURM_PROCID": "1"}  # the tasks of `srun python train.py` share `path`
    assert job.fresh_dir(path, srun_task) == path and not (tmp_path / "outputs" / "03-04-05-4").exists()


def test_a_run_dir_below_a_file_is_one_line_and_one_that_can_be_made_is_left_to_hydra(tmp_path: Path):
    """train.py checks a hydra.run.dir set on the command line as the run starts; fresh_dir, the configs' default run
    and sweep dirs, as it makes one; the sweep summary, a hydra.sweep.dir (the CLI row: test_bad_input.py)."""
    (tmp_path / "notes.txt").write_text("")
    for run_dir in (tmp_path / "notes.txt", tmp_path / "notes.txt" / "a" / "run"):
        with pytest.raises(UsageError) as error:
            job.check_run_dir(run_dir)
        assert str(error.value) == f"cannot make {run_dir}, the folder of this run's files: {tmp_path / 'notes.txt'} " \
                                   "is not a folder"
    job.check_run_dir(tmp_path / "outputs" / "a" / "run")
    job.check_run_dir(tmp_path)  # an existing folder: a resumed run's
    assert sorted(tmp_path.iterdir()) == [tmp_path / "notes.txt"]  # nothing made: Hydra makes it as the job starts
    with pytest.raises(UsageError, match=r"^cannot make .*/notes.txt/03-04-05, the folder of this run's files: "):
        job.fresh_dir(str(tmp_path / "notes.txt" / "03-04-05"), {})


def test_train_py_s_hooks_refuse_a_run_or_sweep_dir_below_a_file_in_one_line(tmp_path: Path, monkeypatch, capsys):
    """The hooks Hydra calls before it makes the dir: the schema's check as a run starts, the sweep summary's as a
    sweep does (the same path to the `error:` line as test_bad_input.py's schema rows)."""
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)  # restored afterwards: on_run_start sets it, as Hydra does
    (tmp_path / "notes.txt").write_text("")
    overrides = [f"hydra.run.dir={tmp_path / 'notes.txt' / 'run'}", f"hydra.sweep.dir={tmp_path / 'notes.txt' / 'sw'}"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        config = compose("config", overrides, return_hydra_config=True)
    for hook, folder in ((schema.CheckBeforeWriting().on_run_start, "run"),
                         (sweep_summary.SweepSummary("val/acc", "max").on_multirun_start, "sw")):
        with pytest.raises(SystemExit) as stopped:
            hook(config)
        assert stopped.value.code == 2
        assert capsys.readouterr().err == f"error: cannot make {tmp_path / 'notes.txt' / folder}, the folder of this " \
                                          f"run's files: {tmp_path / 'notes.txt'} is not a folder\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any folder")
def test_a_run_dir_in_a_folder_this_user_cannot_write_is_refused(tmp_path: Path):
    (tmp_path / "shared").mkdir(mode=0o555)
    with pytest.raises(UsageError) as error:
        job.check_run_dir(tmp_path / "shared" / "outputs" / "run")
    assert str(error.value) == (f"cannot make {tmp_path / 'shared' / 'outputs' / 'run'}, the folder of this run's "
                                f"files: {tmp_path / 'shared'} is not writable by this user")


def test_the_configs_run_and_sweep_dirs_are_fresh(tmp_path: Path, monkeypatch):
    """conf/'s default dirs, train.py's and eval.py's: a second run started in the same second gets DIR-2."""
    timestamped = [line for path in (REPO / "conf").rglob("*.yaml") for line in path.read_text().splitlines()
                   if line.strip().startswith("dir:") and "run_timestamp" in line]  # the presets' too (debug=fast)
    assert len(timestamped) == 7 and all(line.strip().startswith("dir: ${fresh_dir:") for line in timestamped)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DDP_TEMPLATE_RUN_STARTED_AT", "2030-01-02T03:04:05")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for config_name, overrides in (("config", []), ("eval", ["checkpoint=x.pt", "dataset=digits"])):
            hydra = compose(config_name, overrides, return_hydra_config=True).hydra
            for key in ("run", "sweep"):
                first = hydra[key].dir
                for variable in [name for name in os.environ if name.startswith("DDP_TEMPLATE_DIR_")]:
                    monkeypatch.delenv(variable)  # as in another process
                assert first.endswith("2030-01-02/03-04-05") and hydra[key].dir == f"{first}-2"
                assert (tmp_path / first).is_dir() and (tmp_path / f"{first}-2").is_dir()


def test_only_rank_zero_writes_hydra_files(monkeypatch):
    job.register_resolvers()
    config = OmegaConf.create({"subdir": "${main_rank_only:.hydra}"})
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert config.subdir == ".hydra"
    monkeypatch.setenv("RANK", "1")
    assert config.subdir is None


def adopted_environment(extra: dict[str, str]) -> dict[str, str]:
    """The launcher variables `adopt_cluster_env` exports, given a job environment (in a fresh process)."""
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SUBMITIT_EXECUTOR", ranks.PORT_FILE)
    env = {k: v for k, v in os.environ.items() if k not in keys and not k.startswith(("SLURM_", "SUBMITIT_"))}
    code = (f"import json, os, sys; sys.path.insert(0, {str(REPO)!r}); from src.parallel import ranks; "
            f"main = ranks.is_main_process(); ranks.adopt_cluster_env(); assert ranks.is_main_process() == main; "
            f"print(json.dumps({{k: os.environ.get(k) for k in {keys!r}}}))")
    result = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("environ, main", [
    ({}, True),
    ({"RANK": "0", "WORLD_SIZE": "2"}, True),
    ({"RANK": "1", "WORLD_SIZE": "2"}, False),
    ({"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_NTASKS": "2"}, False),
    ({"SUBMITIT_EXECUTOR": "slurm", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, True),
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4"}, False),  # a task of `srun python train.py`
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, True),
])
def test_the_main_process_is_read_from_the_launchers_variables_without_changing_them(environ, main):
    before = dict(environ)
    assert ranks.is_main_process(environ) is main
    assert environ == before


def test_a_run_dir_holding_only_hydras_files_was_made_for_this_run(tmp_path: Path):
    assert job.holds_only_hydras_files(tmp_path / "new")
    (tmp_path / "run" / ".hydra").mkdir(parents=True)
    assert job.holds_only_hydras_files(tmp_path / "run")
    (tmp_path / "run" / "train.log").write_text("an earlier run's\n")
    assert not job.holds_only_hydras_files(tmp_path / "run")


def test_the_resume_command_composes_the_runs_config_again_and_quotes_for_the_shell(tmp_path: Path):
    overrides = ("model=mlp", "model.hidden_sizes=[32,32]", "trainer.max_steps=5", "resume=auto")
    context = job.RunContext(tmp_path / "my run", created=True, in_sweep=False, overrides=overrides, choices={},
                             composing=("--config-dir", "my conf", "hydra.searchpath=[file://x]"))
    args = ["--config-dir", "my conf", "hydra.searchpath=[file://x]", "model=mlp", "model.hidden_sizes=[32,32]"]
    assert shlex.split(context.resume_args()) == [*args, "trainer.max_steps=5", "resume=auto",
                                                  f"hydra.run.dir={tmp_path / 'my run'}"]
    assert shlex.split(context.resume_args("trainer.max_steps=")) == [*args, "resume=auto",
                                                                       f"hydra.run.dir={tmp_path / 'my run'}"]


def test_srun_tasks_export_the_torchrun_contract():
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
             "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    exported = adopted_environment(slurm)
    assert (exported["RANK"], exported["LOCAL_RANK"], exported["WORLD_SIZE"]) == ("3", "1", "4")
    assert exported["MASTER_ADDR"] == "gpu07" and 0 < int(exported["MASTER_PORT"]) < 65536
    assert exported[ranks.PORT_FILE] is None  # no submitit job folder: the ranks meet on submitit's port


def test_a_submitit_task_is_told_where_rank_zero_writes_the_port(tmp_path: Path):
    slurm = {"SUBMITIT_EXECUTOR": "slurm", "SUBMITIT_FOLDER": str(tmp_path / "%j"), "SLURM_JOB_ID": "4242",
             "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "1",
             "SLURM_JOB_NODELIST": "gpu07"}
    exported = adopted_environment(slurm)
    assert exported["RANK"] == "1" and exported[ranks.PORT_FILE] == str(tmp_path / "4242" / "4242_master_port")


def test_a_single_slurm_task_stays_a_single_process():
    exported = adopted_environment({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert exported["WORLD_SIZE"] is None and exported["RANK"] is None


@pytest.mark.parametrize("configured", [False, True])
def test_self_launch_rendezvous_on_the_configured_port(monkeypatch, tmp_path: Path, configured: bool):
    master_port = free_port() if configured else None

    launched = {}

    def record_launch(config, entrypoint):
        launched["endpoint"] = config.rdzv_endpoint
        return lambda *args: None

    monkeypatch.setattr(workers, "elastic_launch", record_launch)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    workers.launch_workers("train.py", 2, tmp_path, [], master_port, device="cpu", backend="gloo")
    expected = f"localhost:{master_port}" if configured else "localhost:0"  # port 0: the OS picks a free one
    assert launched == {"endpoint": expected}


def test_a_busy_master_port_is_refused_before_any_worker_starts(tmp_path: Path):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert not workers.port_is_free(port)
        with pytest.raises(UsageError, match=f"dist.master_port={port} is in use on localhost; pick another port"):
            workers.launch_workers("train.py", 2, tmp_path, [], port)
    assert workers.port_is_free(port)


@pytest.mark.parametrize("exit_codes, usage_error", [
    ([2, 2], True),
    ([2, -15], True),  # rank 0 stopped on the usage error first; the agent SIGTERMed rank 1 in its grace second
    ([-15, 2], True),
    ([1, -15], False),  # a crash
    ([2, 1], False),
    ([-9, -15], False),  # killed: no usage error at all
])
def test_a_group_stopped_on_a_usage_error_is_recognised(exit_codes, usage_error):
    assert workers.stopped_on_a_usage_error(exit_codes) is usage_error


def test_override_quoting_survives_hydras_grammar():
    assert job.quote_override("/tmp/a b/it's") == "'/tmp/a b/it\\'s'"


def make_job(sweep: Path, num: int, overrides: list[str], epochs: int, metrics: dict | None, failed: bool = False):
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(overrides), job / ".hydra" / "overrides.yaml")
    OmegaConf.save(OmegaConf.create({"trainer": {"epochs": epochs}}), job / ".hydra" / "config.yaml")
    if metrics is not None:
        (job / "metrics.json").write_text(json.dumps(metrics))
    if failed:
        (job / jobs.FAILED_MARKER).write_text("RuntimeError: boom\n")


def test_sweep_summary_sorts_completed_jobs_by_the_metric(tmp_path: Path):
    make_job(tmp_path, 0, ["optimizer.lr=0.1"], 2, {"epoch": 2, "val/acc": 0.91, "val/loss": 0.3})
    make_job(tmp_path, 1, ["optimizer.lr=0.01"], 2, {"epoch": 2, "val/acc": 0.95, "val/loss": 0.2})
    make_job(tmp_path, 2, ["optimizer.lr=1.0"], 2, {"epoch": 1, "val/acc": 0.99}, failed=True)
    make_job(tmp_path, 10, ["optimizer.lr=0.5"], 2, {"epoch": 1, "val/acc": 0.97})
    rows = sweep_summary.collect(tmp_path, "val/acc", "max")
    assert [(r["job"], r["status"]) for r in rows] == [
        ("1", "completed"), ("0", "completed"), ("2", "failed"), ("10", "incomplete")]
    by_loss = sweep_summary.collect(tmp_path, "val/loss", "min")
    assert [r["job"] for r in by_loss][:2] == ["1", "0"]
    table = sweep_summary.SweepSummary("val/acc", "max").write(tmp_path)
    assert table.splitlines()[2].startswith("| 1 | completed | 0.9500 | 0.2000 |")
    assert (tmp_path / "summary.md").read_text() == table
    csv_lines = (tmp_path / "summary.csv").read_text().splitlines()
    # The columns are the metrics the jobs' task wrote: the monitored one first.
    assert csv_lines[0] == "job,status,overrides,val/acc,val/loss,epoch,samples_per_s,job_dir"
    assert csv_lines[1].startswith("1,completed,optimizer.lr=0.01,0.95,0.2,")


def test_sweep_summary_shows_pruned_jobs_and_the_command_of_the_best(tmp_path: Path):
    make_job(tmp_path, 0, ["optimizer.lr=0.1"], 3, {"epoch": 3, "val/acc": 0.91})
    make_job(tmp_path, 1, ["optimizer.lr=9.0"], 3, {"epoch": 1, "val/acc": 0.2, "stop_reason": "pruned",
                                                   "stopped_at_epoch": 1})
    make_job(tmp_path, 2, ["optimizer.lr=0.01", "dataset.root=my data"], 3, {"epoch": 3, "val/acc": 0.95})
    table = sweep_summary.SweepSummary("val/acc", "max").write(tmp_path)
    assert table.splitlines()[0] == "| job | status | val/acc | epoch | pruned_epoch | samples_per_s | overrides |"
    assert table.splitlines()[4].startswith("| 1 | pruned | 0.2000 | 1 | 1 |")
    command = "python train.py optimizer.lr=0.01 'dataset.root=my data'"
    assert table.endswith(f"Best job (2), trained again by:\n\n    {command}\n")
    table = sweep_summary.SweepSummary("val/acc", "max").write(tmp_path, ("--config-dir", "my conf"))
    assert table.endswith("\n    python train.py --config-dir 'my conf' optimizer.lr=0.01 'dataset.root=my data'\n")


def test_sweep_summary_columns_are_the_tasks_metrics(tmp_path: Path):
    make_job(tmp_path, 0, ["optimizer.lr=0.1"], 1, {"epoch": 1, "val/loss": 0.4, "val/mae": 0.5, "val/r2": 0.4,
                                                   "train/mae": 0.3, "val/num_samples": 88})
    make_job(tmp_path, 1, ["optimizer.lr=0.01"], 1, {"epoch": 1, "val/loss": 0.3, "val/mae": 0.4, "val/r2": 0.5,
                                                    "train/mae": 0.2, "val/num_samples": 88})
    table = sweep_summary.SweepSummary("val/mae", "min").write(tmp_path)
    assert table.splitlines()[0] == ("| job | status | val/mae | val/loss | val/r2 | train/mae | epoch | samples_per_s "
                                     "| overrides |")
    assert table.splitlines()[2].startswith("| 1 | completed | 0.4000 | 0.3000 | 0.5000 | 0.2000 | 1 | - |")


def test_sweep_summary_sorts_by_a_val_ema_metric_and_shows_it_after_val(tmp_path: Path):
    make_job(tmp_path, 0, ["trainer.ema.decay=0.9"], 1, {"epoch": 1, "val/acc": 0.96, "val_ema/acc": 0.93,
                                                          "train/acc": 0.9})
    make_job(tmp_path, 1, ["trainer.ema.decay=0.99"], 1, {"epoch": 1, "val/acc": 0.95, "val_ema/acc": 0.97,
                                                           "train/acc": 0.9})
    assert [r["job"] for r in sweep_summary.collect(tmp_path, "val_ema/acc", "max")] == ["1", "0"]
    table = sweep_summary.SweepSummary("val/acc", "max").write(tmp_path)
    assert table.splitlines()[0].startswith("| job | status | val/acc | val_ema/acc | train/acc | epoch |")


@pytest.mark.parametrize("environ,restarted", [
    ({}, False), ({"TORCHELASTIC_RESTART_COUNT": "0"}, False), ({"TORCHELASTIC_RESTART_COUNT": "2"}, True),
    ({"SLURM_RESTART_COUNT": "1"}, True), ({"SLURM_RESTART_COUNT": "0"}, False)])
def test_restarts_and_requeues_are_recognised(environ, restarted):
    assert ranks.resume_setting(None, environ) == ("auto" if restarted else None)
    assert ranks.resume_setting("ckpt.pt", environ) == "ckpt.pt"  # a path named is resumed from, restart or not


def test_a_wrapped_usage_error_stays_findable_through_the_torchrun_wrapper(monkeypatch):
    """Hydra's instantiate wraps a builder's UsageError (`raise InstantiationException(...) from error`);
    under torchrun the error passes @record unrecorded and must come out with that cause intact."""
    from src.common.errors import UsageError, find_usage_error

    monkeypatch.setenv("WORLD_SIZE", "2")  # a launcher's worker: recording_errors wraps in @record
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", "/nonexistent/error.json")

    def build():
        try:
            raise UsageError("image folder data/train not found")
        except UsageError as error:
            raise RuntimeError("Error in call to target 'src.components.datasets.image_folder'") from error

    with pytest.raises(RuntimeError) as raised:
        workers.recording_errors(build)()
    assert str(find_usage_error(raised.value)) == "image folder data/train not found"


PDEATHSIG_OF_THIS_PROCESS = """
import ctypes, os, sys
from src.parallel import workers
workers.die_with_launcher()
signal = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(signal), 0, 0, 0)  # PR_GET_PDEATHSIG
print(signal.value)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("launcher,armed", [("parent", True), ("another", False), (None, False)])
def test_only_a_worker_of_launch_workers_is_armed_to_die_with_it(launcher: str | None, armed: bool):
    """The worker's parent is the launcher named in its environment: SIGKILL when it dies (9). A process
    whose parent is another, or that no launch_workers started, is left as it is (0)."""
    env = {key: value for key, value in os.environ.items() if key != workers.LAUNCHER_PID}
    if launcher is not None:
        env[workers.LAUNCHER_PID] = str(os.getpid() if launcher == "parent" else os.getpid() + 1_000_000)
    result = subprocess.run([sys.executable, "-c", PDEATHSIG_OF_THIS_PROCESS], cwd=REPO, env=env,
                            capture_output=True, text=True, check=True)
    assert int(result.stdout) == (9 if armed else 0)
