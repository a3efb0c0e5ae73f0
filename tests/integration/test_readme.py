"""The commands of the README and of docs/ are real: each composes here, and the test named for it runs it.

Commands that need GPUs, 8 processes or a cluster run in the named test scaled down (2 CPU
processes, one epoch); SLURM runs through submitit's local executor, which shares its code path.
"""

from __future__ import annotations

import importlib.util
import math
import re
import shlex
import sys
from pathlib import Path

import pytest
from conftest import REPO, check, run
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from src.config import schema  # noqa: F401 - registers the schema
from src.parallel import job  # noqa: F401 - registers ${run_timestamp:}, ${data:} ... as train.py does

# The README and the pages of docs/ it links: every command in them is listed below.
GUIDE = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

pytestmark = pytest.mark.template  # checks this template's own README, docs and benchmarks (a fork deselects them)

# Each command of the README and docs/ -> where it is run (test file::function), scaled down if it needs hardware we
# lack.
EXERCISED_BY = {
    "make train": "test_train_modes.py::test_make_train_reaches_98_percent_on_the_default_config",
    'make train ARGS="model=mlp"': "test_train_modes.py::test_make_train_reaches_98_percent_on_the_default_config",
    "make test": ".ci/run",
    # The inner loop runs a subset of the suite (unit tests and quick CLI checks, such as this one); a fork's run
    # deselects the template's own checks: both are `make test` with other pytest arguments.
    "make test-fast": "test_train_cli.py::test_help_lists_groups_and_cfg_job_prints_the_config_without_a_run_dir",
    "make test ARGS='-m \"not template\"'": ".ci/run",
    'make test-fast MARKS="not slow and not template"':  # what the fork's suite runs
        "test_fork_follow.py::test_the_fork_facing_suite_passes_in_the_fork",
    "python benchmarks/run.py": "test_readme.py::test_the_benchmark_script_writes_its_table",
    "python benchmarks/chaos.py --trials 20 --seed 0": "test_chaos.py::test_three_chaos_trials_end_bitwise_equal",
    "python eval.py checkpoint=outputs/DATE/TIME/checkpoints/best.pt":
        "test_eval_cli.py::test_eval_reproduces_the_training_runs_val_metrics",
    "torchrun --nproc_per_node=2 eval.py checkpoint=PATH": "test_eval_cli.py::test_sharded_eval_equals_one_process",
    "python eval.py checkpoint=outputs/DATE/TIME/checkpoints/best.pt weights=ema":
        "test_ema_cli.py::test_eval_of_the_ema_weights_reproduces_val_ema",
    "python train.py callbacks.ema.decay=0.999 trainer.monitor=val_ema/acc":
        "test_ema_cli.py::test_val_ema_is_reported_every_epoch_and_picks_best",
    "python train.py": "test_train_cli.py::test_single_process_run_dir_contract",
    "python train.py --cfg job":
        "test_train_cli.py::test_help_lists_groups_and_cfg_job_prints_the_config_without_a_run_dir",
    "python train.py --help":
        "test_train_cli.py::test_help_lists_groups_and_cfg_job_prints_the_config_without_a_run_dir",
    "python train.py -m dist.nproc_per_node=2 optimizer=sgd,adam":
        "test_launch_cli.py::test_sweep_of_ddp_groups",
    "python train.py -m optimizer.lr=0.1,0.01":
        "test_sweeps_cli.py::test_a_grid_sweep_killed_during_job_3_continues_where_it_stopped",
    "python train.py -m hydra/sweeper=optuna hydra.sweeper.n_trials=20 'optimizer.lr=tag(log,interval(1e-4,1e-1))' "
    "'optimizer=choice(sgd,adamw)' dataset.batch_size=choice(32,64)":
        "test_sweeps_cli.py::test_the_study_in_optuna_db_holds_each_two_rank_jobs_result",
    "python train.py -m hydra/sweeper=optuna hydra.sweeper.pruner=median dist.nproc_per_node=2 "
    "'optimizer.lr=tag(log,interval(1e-4,1))'":
        "test_sweeps_cli.py::test_a_pruned_trial_stops_every_rank_after_the_same_epoch_with_a_checkpoint",
    "python train.py -m optimizer=sgd,adam hydra.sweep.dir=outputs/multirun/2026-11-23/10-00-00":
        "test_sweeps_cli.py::test_a_grid_sweep_killed_during_job_3_continues_where_it_stopped",
    "python train.py -m hydra/launcher=local_ddp": "test_launch_cli.py::test_submitit_tasks_form_one_ddp_group",
    "python train.py -m hydra/launcher=slurm hydra.launcher.partition=gpu optimizer.lr=0.1,0.01":
        "test_launch.py::test_srun_tasks_export_the_torchrun_contract",
    "python train.py debug=fast": "test_presets.py::test_debug_fast_is_a_two_step_smoke_run_kept_apart",
    "python train.py debug=overfit": "test_presets.py::test_debug_overfit_drives_the_loss_to_zero",
    "python train.py debug=profile": "test_presets.py::test_debug_profile_writes_a_trace_of_the_recorded_steps",
    "python train.py dist.nproc_per_node=8": "test_run_report_cli.py::test_self_launch_matches_torchrun",
    "python train.py experiment=digits_cnn": "test_presets.py::test_digits_experiment_is_the_default_run",
    "python train.py experiment=seed_tabular_binary": "test_tasks_cli.py::test_seed_tabular_binary_reaches_95_percent",
    "python train.py task=regression dataset=diabetes model=mlp":
        "test_tasks_cli.py::test_diabetes_regression_reaches_r2_035",
    "python train.py experiment=seed_two_input_l1":
        "test_tasks_cli.py::test_seed_two_input_beats_the_mean_predictor_four_times",
    "python train.py experiment=mnist_cnn": "test_presets.py::test_file_dataset_experiments_run_end_to_end",
    "python train.py experiment=seed_cifar10_lenet": "test_presets.py::test_file_dataset_experiments_run_end_to_end",
    "python train.py task=regression dataset=two_input_synthetic model=two_input_cnn":
        "test_task_equivalence.py::test_sync_bn_two_ranks_train_the_one_process_model",
    "python train.py task=causal_lm model=tiny_gpt dataset=python_docs trainer.epochs=5":
        "test_token_counts.py::test_unequal_token_counts_train_the_one_process_model",
    "python train.py experiment=fashion_mnist_cnn": "test_presets.py::test_file_dataset_experiments_run_end_to_end",
    "torchrun --nproc_per_node=8 train.py experiment=cifar10_resnet18":
        "test_presets.py::test_file_dataset_experiments_run_end_to_end",
    "python train.py model=mlp optimizer=sgd optimizer.lr=0.05": "test_train_modes.py::test_readme_mlp_command",
    "python train.py resume=auto hydra.run.dir=outputs/2026-11-22/10-00-00":
        "test_fault_tolerance.py::test_a_step_checkpoint_resumes_mid_epoch_exactly",
    "python train.py init_from=outputs/DATE/TIME/checkpoints/best.pt init_from_strict=false dataset=synthetic "
    "dataset.num_classes=4 trainer.freeze=[features]":
        "test_finetune_cli.py::test_finetune_into_four_classes_reinitialises_the_head_and_probes_linearly",
    "python train.py trainer.max_steps=10000":
        "test_fault_tolerance.py::test_a_step_checkpoint_resumes_mid_epoch_exactly",
    "tensorboard --logdir outputs": "test_train_cli.py::test_tensorboard_events_are_readable",
    "torchrun --nnodes=2 --node_rank=K --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT train.py":
        "test_launch_cli.py::test_two_torchrun_agents_train_as_one_group",
    "torchrun --nproc_per_node=2 train.py -m optimizer.lr=0.1,0.01": "test_launch_cli.py::test_torchrun_runs_a_sweep",
    "torchrun --nproc_per_node=8 --max-restarts=3 train.py trainer.checkpoint_every_steps=500":
        "test_fault_tolerance.py::test_a_killed_worker_is_restarted_and_the_run_ends_as_if_never_interrupted",
    "torchrun --nproc_per_node=8 train.py model=cnn":
        "test_run_report_cli.py::test_torchrun_two_workers_share_one_run_dir",
    "torchrun --nproc_per_node=2 train.py dist=fsdp":
        "test_fsdp_cli.py::test_fsdp_trains_the_ddp_model_with_the_same_metrics",
    "torchrun --nproc_per_node=3 train.py dist=fsdp resume=auto hydra.run.dir=outputs/2026-11-22/10-00-00":
        "test_fsdp_cli.py::test_stopped_on_2_ranks_resumes_on_another_world_size",
    "python eval.py checkpoint=outputs/DATE/TIME/checkpoints/last":
        "test_fsdp_cli.py::test_eval_reads_a_sharded_checkpoint",
    "python train.py dataset=arrow dataset.root=data/images-arrow model=resnet18 dataset.num_workers=8":
        "test_data_cli.py::test_arrow_on_two_ranks_stopped_and_resumed_trains_bitwise_the_image_folder_run",
    "python train.py dataset=arrow dataset.root=data/pq-arrow dataset.features=all model=mlp":
        "test_datasets_cli.py::test_a_tables_columns_train_model_mlp_as_one_features_vector",
    "python benchmarks/fsdp_memory.py": "test_readme.py::test_the_fsdp_benchmarks_write_their_tables",
    "python benchmarks/fsdp_memory.py --shapes": "test_readme.py::test_the_fsdp_benchmarks_write_their_tables",
    "python benchmarks/fsdp_speed.py": "test_readme.py::test_the_fsdp_benchmarks_write_their_tables",
    "python train.py logger=mlflow logger.mlflow.tracking_uri=http://127.0.0.1:5000":
        "test_trackers_cli.py::test_a_killed_rank_restarted_by_torchrun_is_one_run_with_each_step_once",
    "python train.py logger=wandb logger.wandb.mode=offline":
        "test_trackers_cli.py::test_a_sigterm_stop_then_resume_auto_continue_the_checkpoints_runs",
    "python train.py logger=csv":
        "test_trackers_cli.py::test_a_killed_rank_restarted_by_torchrun_is_one_run_with_each_step_once",
    "python benchmarks/checkpoint_stall.py": "test_readme.py::test_the_checkpoint_stall_benchmark_writes_its_table",
    "python benchmarks/rank_agreement.py": "test_readme.py::test_the_rank_agreement_benchmark_writes_its_table",
    "python train.py experiment=gan_digits": "test_recipes_cli.py::test_gan_stopped_mid_epoch_resumes_bitwise",
    "torchrun --nproc_per_node=2 train.py experiment=gan_digits dist=fsdp":
        "test_recipes_cli.py::test_gan_under_fsdp_trains_bitwise_what_ddp_trains",
    "python train.py experiment=digits_cnn hydra.run.dir=outputs/teacher":
        "test_recipes_cli.py::test_gan_with_a_judge_reports_its_confidence_on_samples_and_on_noise",
    "python train.py experiment=distill_digits aux.teacher.path=outputs/teacher/checkpoints/best.pt":
        "test_recipes_cli.py::test_distill_keeps_the_teacher_out_of_the_checkpoint_and_resumes_bitwise",
    "python train.py experiment=simclr_digits": "test_recipes_cli.py::test_simclr_stopped_mid_epoch_resumes_bitwise",
    "python train.py experiment=finetune_timm dataset.root=PATH model.pretrained=WEIGHTS":
        "test_pretrained_cli.py::test_the_fine_tuning_recipe_trains_a_pretrained_timm_model_from_its_file",
    "python train.py experiment=segment_shapes":
        "test_pretrained_cli.py::test_segmentation_miou_in_eval_is_the_standalone_miou_on_any_world_size",
}


def readme_commands(text: str | None = None) -> set[str]:
    """Commands in the bash blocks and inline code of `text` (default: the README and every page of docs/): make
    targets, tensorboard, and python / torchrun commands that name a script (bare mentions such as
    `torchrun --standalone` are prose, not commands)."""
    text = "\n".join(path.read_text() for path in GUIDE) if text is None else text
    candidates = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        candidates += [re.split(r"\s+#", line)[0].strip() for line in block.splitlines()]
    candidates += [code.strip() for code in re.findall(r"`([^`\n]+)`", text)]
    return {
        command for command in candidates
        if re.match(r"(make \w|tensorboard )", command)
        or (re.match(r"(python|torchrun) ", command) and ".py" in command)
    }


def test_every_readme_command_is_listed_with_the_test_that_runs_it():
    assert readme_commands() == set(EXERCISED_BY)


def test_the_docs_pages_are_few_and_linked_from_the_readme():
    """The README stays short (at most 250 lines) and indexes every page of docs/ (at most 10), each page's
    commands counted above."""
    readme = (REPO / "README.md").read_text()
    pages = sorted(path.name for path in (REPO / "docs").glob("*.md"))
    assert len(readme.splitlines()) <= 250 and 0 < len(pages) <= 10
    assert [page for page in pages if f"](docs/{page})" not in readme] == []


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), re.M)}


def test_every_relative_link_of_the_guide_reaches_a_file_and_its_heading():
    broken = []
    for page in GUIDE:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists() or (anchor and anchor not in heading_anchors(file.read_text())):
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert broken == []


@pytest.mark.parametrize("where", sorted(set(EXERCISED_BY.values())))
def test_the_listed_tests_exist(where: str):
    if where == ".ci/run":
        assert "make test" in (REPO / ".ci" / "run").read_text()
        return
    file_name, function = where.split("::")
    (path,) = (REPO / "tests").rglob(file_name)
    assert re.search(rf"^def {function}\(", path.read_text(), re.M), where


def overrides_of(command: str) -> tuple[str, list[str]]:
    """(config name, overrides) of a train.py / eval.py command; a sweep's first job."""
    words = shlex.split(command)
    script = next(word for word in words if word.endswith(".py"))
    args = [word for word in words[words.index(script) + 1:] if word != "-m"]
    first_job = [first_value(arg) for arg in args]
    return ("eval" if script == "eval.py" else "config"), first_job


def first_value(arg: str) -> str:
    """A sweep override's first value: `a` of `key=a,b` or `key=choice(a,b)`, `low` (a float) of
    `key=interval(low,high)` or `key=tag(log,interval(low,high))`."""
    key, _, value = arg.partition("=")
    function = re.fullmatch(r"(?:tag\(\w+,\s*)?(choice|range|interval)\(([^,)]*)[,)].*", value)
    if function:
        first = function.group(2).strip()
        return f"{key}={float(first) if function.group(1) == 'interval' else first}"
    return re.sub(r"=([^,\[]*),.*", r"=\1", arg)


COMPOSABLE = sorted(
    command for command in EXERCISED_BY
    if re.search(r"\b(train|eval)\.py\b", command) and not re.search(r"--(help|cfg)", command)
)


@pytest.mark.parametrize("command", COMPOSABLE)
def test_readme_commands_compose_and_pass_the_value_checks(command: str, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # composing makes the default run dir (fresh_dir): not in the repo's outputs/
    config_name, overrides = overrides_of(command)
    if config_name == "eval":  # eval.py registers its `checkpoint` dataset option itself: ask it
        composed = check(run([sys.executable, str(REPO / "eval.py"), *overrides, "--cfg", "job"], REPO)).stdout
        assert f"checkpoint: {overrides[0].split('=', 1)[1]}" in composed
        return
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
    if config_name == "config":
        schema.check_train_config(OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"]))
    choices = cfg.hydra.runtime.choices
    for key, value in (override.split("=", 1) for override in overrides):
        if key in choices:  # a group option: model=mlp, hydra/launcher=slurm
            assert choices[key] == value
        elif not key.startswith("hydra."):
            assert OmegaConf.select(cfg, key) == OmegaConf.create(f"v: {value}").v, key


HAS_LIGHTNING = importlib.util.find_spec("lightning") is not None  # `make test` installs it (requirements-dev.txt)


def test_the_benchmark_script_writes_its_table(tmp_path: Path):
    """A smoke run of `python benchmarks/run.py` (the real numbers come from a full run: RESULTS.md): the
    template, the bare loop and, where installed, a Lightning Trainer on the digits job."""
    output = tmp_path / "RESULTS.md"
    check(run([sys.executable, str(REPO / "benchmarks" / "run.py"), "--repeats", "1", "--epochs", "1",
               "--cases", "lightning" if HAS_LIGHTNING else "digits", "--output", str(output),
               "--template-args", "callbacks.ema.decay=0.9"], tmp_path))
    text = output.read_text()
    assert "--template-args callbacks.ema.decay=0.9`" in text  # the template ran with the feature measured
    rows = {row[0].strip(): [float(cell) for cell in row[1:]]
            for row in (line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| digits"))}
    versus = ("", " vs Lightning") if HAS_LIGHTNING else ("",)
    assert set(rows) == {f"digits + cnn, 1 process: {measure}{against}"
                         for measure in ("training samples/s", "whole process, s", "start to first step, s")
                         for against in versus}
    for ours, other, ratio in rows.values():
        assert ours > 0 and other > 0 and math.isfinite(ratio)
        # Each value is printed to 2 decimals, the ratio to 3 from the unrounded values: within what rounding allows
        # (a start-up of 0.22 s is 0.215-0.225 s, so a ratio of a few tenths of a second is known to a few percent).
        assert (ours - 0.005) / (other + 0.005) - 0.0005 <= ratio <= (ours + 0.005) / (other - 0.005) + 0.0005
    if HAS_LIGHTNING:
        assert "| case | template | Lightning | template / Lightning |" in text
        # The same template runs are compared with both baselines.
        assert rows["digits + cnn, 1 process: training samples/s vs Lightning"][0] == \
            rows["digits + cnn, 1 process: training samples/s"][0]


def test_the_fsdp_benchmarks_write_their_tables(tmp_path: Path):
    """Smoke runs of `python benchmarks/fsdp_memory.py` (a 66k-parameter MLP) and `python benchmarks/fsdp_speed.py`
    (1 repeat of 1 epoch); the real numbers come from full runs (FSDP_MEMORY.md, FSDP_SPEED.md)."""
    memory, speed = tmp_path / "memory.md", tmp_path / "speed.md"
    check(run([sys.executable, str(REPO / "benchmarks" / "fsdp_memory.py"), "--width", "256", "--layers", "1",
               "--without-whole", "--output", str(memory)], tmp_path))
    rows = [line.split("|")[1:-1] for line in memory.read_text().splitlines() if line.startswith(("| ddp", "| fsdp"))]
    state_ratio = {(row[0].strip(), int(row[1])): float(row[6]) for row in rows}
    # The bytes each rank holds: all of them under DDP, 1/W under FSDP (shards padded to a multiple of W).
    assert state_ratio[("ddp", 1)] == state_ratio[("ddp", 2)] == state_ratio[("ddp", 3)] == 1.0
    assert state_ratio[("fsdp", 2)] == pytest.approx(1 / 2, abs=0.01)
    assert state_ratio[("fsdp", 3)] == pytest.approx(1 / 3, abs=0.01)
    check(run([sys.executable, str(REPO / "benchmarks" / "fsdp_speed.py"), "--repeats", "1", "--epochs", "1",
               "--output", str(speed)], tmp_path))
    rows = {row[0].strip(): (float(row[2]), float(row[3])) for row in
            (line.split("|")[1:-1] for line in speed.read_text().splitlines() if line.startswith(("| ddp", "| fsdp")))}
    assert set(rows) == {"ddp", "fsdp (default: one unit)", "fsdp, a unit per child", "fsdp, AdamW's foreach kernels"}
    for samples_per_s, ratio in rows.values():
        assert samples_per_s > 0 and abs(ratio - samples_per_s / rows["ddp"][0]) < 0.01
    shapes = tmp_path / "shapes.md"  # the frozen MLP's host memory by layer shape, two small shapes
    check(run([sys.executable, str(REPO / "benchmarks" / "fsdp_memory.py"), "--shapes", "2x256", "1x512",
               "--output", str(shapes)], tmp_path))
    rows = [line.split("|")[1:-1] for line in shapes.read_text().splitlines()
            if line.startswith(("| 2x256", "| 1x512"))]
    assert [row[0].strip() for row in rows] == ["2x256", "1x512"]
    assert [row[1].strip() for row in rows] == ["0.1M", "0.3M"]  # the digits MLP: 64 inputs, 10 outputs
    for row in rows:  # a peak per rank, with and without the allocator setting
        assert all(len(cell.split("/")) == 2 for cell in row[4:6])


def test_the_checkpoint_stall_benchmark_writes_its_table(tmp_path: Path):
    """A smoke run of `python benchmarks/checkpoint_stall.py` (a 66k-parameter MLP, 3 saves, 1 run per mode, the
    sharded store: the one whose writer thread runs collectives); the real numbers come from the full run
    (CHECKPOINT_STALL.md)."""
    table = tmp_path / "stall.md"
    check(run([sys.executable, str(REPO / "benchmarks" / "checkpoint_stall.py"), "--width", "256", "--layers", "1",
               "--saves", "3", "--steps", "1", "--repeats", "1", "--strategies", "fsdp", "--dir", str(tmp_path),
               "--output", str(table)], tmp_path))
    rows = {row[0].strip(): [float(value) for value in row[2:]] for row in
            (line.split("|")[1:-1] for line in table.read_text().splitlines() if line.startswith(("| ddp", "| fsdp")))}
    assert set(rows) == {"fsdp"}
    for sync, asynchronous, ratio, *steps in rows.values():
        assert sync > 0 and asynchronous > 0 and all(step > 0 for step in steps)
        # Each value is rounded to 0.0005: the printed stalls give the ratio within 0.0005 (1 + ratio) / (sync - 0.0005)
        # of the unrounded one, which was rounded by 0.0005 in turn.
        assert ratio == pytest.approx(asynchronous / sync, abs=0.0005 + 0.0005 * (1 + ratio) / (sync - 0.0005))


def test_the_rank_agreement_benchmark_writes_its_table(tmp_path: Path):
    """A smoke run of `python benchmarks/rank_agreement.py` (1 optimizer step of the default run, 1 process against
    2 ranks); the real numbers come from the full run (RANK_AGREEMENT.md, pasted into docs/trust.md)."""
    table = tmp_path / "agreement.md"
    check(run([sys.executable, str(REPO / "benchmarks" / "rank_agreement.py"), "--steps", "1", "--configs", "default",
               "--output", str(table)], tmp_path))
    text = table.read_text()
    assert "torch " in text and "Measured " in text  # the date, the machine and the torch version
    (row,) = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| default")]
    assert int(row[2]) == 1
    # One step: the two runs' parameters and BatchNorm statistics differ by float rounding only.
    assert float(row[3]) < 1e-5 and float(row[5]) < 1e-5
    one, two = (float(value) for value in row[6].split("/"))
    assert 0 <= one <= 1 and 0 <= two <= 1 and float(row[7]) == pytest.approx(abs(one - two), abs=1e-4)
