"""A fork, as the fork guide (docs/forking.md, "A whole fork") shows it: a task, a model and a dataset in a module of
the user's own (dict batches, keyword inputs, a metric of its own) and a callback in another (val samples in
TensorBoard each epoch), YAMLs in a config folder of the user's own found through `hydra.searchpath`, trained on 2
ranks and evaluated by eval.py, with no file of the template changed.

The code and YAMLs are taken from the guide's blocks, so the guide shows what runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, check, metrics, run, torchrun, weights
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.slow


def readme_files() -> dict[str, str]:
    """The fork guide's fenced blocks whose first line is `# <path>` for mine*.py modules and conf/ YAMLs: path ->
    text."""
    readme = (REPO / "docs" / "forking.md").read_text()
    files = {}
    for block in re.findall(r"```(?:python|yaml)\n(.*?)```", readme, re.S):
        first, _, rest = block.partition("\n")
        path = first.removeprefix("# ").strip()
        if re.fullmatch(r"mine\w*\.py", path) or (path.startswith("conf/") and first.startswith("# conf/")):
            files[path] = rest if path.endswith(".yaml") else block
    return files


def git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout


def test_the_readme_example_is_whole():
    assert set(readme_files()) >= {"mine.py", "conf/task/tolerance.yaml", "conf/model/masked_net.yaml",
                                   "conf/dataset/masked_scenes.yaml", "mine_callbacks.py", "conf/callbacks/mine.yaml"}


def test_a_forked_task_model_and_dataset_train_on_two_ranks_and_evaluate(tmp_path: Path):
    template_before = git_status()
    for path, text in readme_files().items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    env = {"PYTHONPATH": str(tmp_path)}
    args = ["task=tolerance", "model=masked_net", "dataset=masked_scenes", "callbacks=mine", "optimizer=adam",
            "optimizer.lr=1e-2", "trainer.epochs=8",
            f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "hydra.run.dir=run"]
    check(torchrun(2, args, tmp_path, env=env))
    trained = metrics(tmp_path / "run")
    assert trained["world_size"] == 2 and trained["val/num_samples"] == 128
    assert trained["step"] == 8 * 512 // 32
    assert trained["val/within"] >= 0.9  # predicting the mean target is within 0.05 for about a quarter
    assert trained["history"][0]["val/within"] < trained["val/within"]
    assert {"features.1.running_mean", "head.weight"} <= set(weights(tmp_path / "run"))  # BatchNorm: sync-BN ran
    check_val_samples(tmp_path, steps_per_epoch=512 // 32)

    eval_args = ["checkpoint=run/checkpoints/last.pt", "hydra.run.dir=eval"]
    refused = run([sys.executable, str(REPO / "eval.py"), *eval_args], tmp_path, env=env)
    assert refused.returncode == 2 and "mine." in refused.stderr  # a saved config never chooses code by itself
    evaluated = check(run([sys.executable, str(REPO / "eval.py"), *eval_args,
                           f"hydra.searchpath=[file://{tmp_path / 'conf'}]"], tmp_path, env=env))
    assert "val/within=" in evaluated.stdout
    result = metrics(tmp_path / "eval")
    assert result["val/within"] == trained["val/within"] and result["num_samples"] == 128
    assert result["val/loss"] == pytest.approx(trained["val/loss"], abs=1e-6)
    assert git_status() == template_before  # no file of the template was written


def check_val_samples(workdir: Path, steps_per_epoch: int) -> None:
    """The guide's callback wrote, each epoch, a table of the first 4 val samples: their targets, and the outputs
    of that epoch's model (the last epoch's: those of the checkpoint's weights)."""
    sys.path.insert(0, str(workdir))
    try:
        import mine
    finally:
        sys.path.remove(str(workdir))
    events = EventAccumulator(str(workdir / "run" / "tb"))
    events.Reload()
    tables = events.Tensors("val/samples/text_summary")
    assert [event.step for event in tables] == [steps_per_epoch * epoch for epoch in range(1, 9)]
    rows = [line.split("|")[1:-1] for line in tables[-1].tensor_proto.string_val[0].decode().splitlines()[2:]]
    val = mine.masked_scenes().val
    model = mine.MaskedNet(in_channels=3, num_outputs=1)
    model.load_state_dict(weights(workdir / "run"))
    model.eval()
    samples = [val[index] for index in range(4)]
    with torch.no_grad():
        outputs = model(torch.stack([s["rgb"] for s in samples]), torch.stack([s["mask"] for s in samples]))
    assert [int(row[0]) for row in rows] == [0, 1, 2, 3]
    assert [float(row[1]) for row in rows] == [round(float(s["target"]), 3) for s in samples]
    assert [float(row[2]) for row in rows] == pytest.approx(outputs.flatten().tolist(), abs=1.5e-3)
