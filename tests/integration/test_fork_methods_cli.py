"""A fork's own method through every launch mode (the research-step issue's item 6), with configs in a folder of the
fork's own: `python train.py dist.nproc_per_node=2` hands its workers the whole command line, `hydra.searchpath`
included; a model whose parameters get no gradient is one line naming dist.find_unused_parameters under DDP."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import check, torchrun, train

pytestmark = pytest.mark.slow

PRESET = """# @package _global_
# The template's GAN recipe under a name of the fork's own.
defaults:
  - /experiment/gan_digits
trainer:
  max_steps: 3
  progress: false
"""

UNUSED = """
import torch
from torch import nn


class Unused(nn.Module):
    def __init__(self, in_features, num_outputs):
        super().__init__()
        self.used = nn.Linear(in_features, num_outputs)
        self.spare = nn.Linear(in_features, num_outputs)  # never called in forward

    def forward(self, x):
        return self.used(x.flatten(1))

    def init_module(self, module, name):
        module.reset_parameters()


class UnusedLater(Unused):
    calls = 0

    def forward(self, x):  # spare is used by the first step's forward only
        self.calls += 1
        used = self.used(x.flatten(1))
        return used + 0 * self.spare(x.flatten(1)) if self.calls == 1 else used
"""


def test_workers_of_dist_nproc_per_node_get_the_fork_s_config_folder(tmp_path: Path):
    (tmp_path / "myconf" / "experiment").mkdir(parents=True)
    (tmp_path / "myconf" / "experiment" / "my_gan.yaml").write_text(PRESET)
    result = check(train(["experiment=my_gan", f"hydra.searchpath=[file://{tmp_path / 'myconf'}]",
                          "dist.nproc_per_node=2", "hydra.run.dir=run"], tmp_path))
    assert "stopped at step 3" in result.stdout + result.stderr
    saved = (tmp_path / "run" / "checkpoints" / "last.pt")
    assert saved.exists() and "world size 2" in (tmp_path / "run" / "train.log").read_text()


@pytest.mark.parametrize("model,message", [
    ("Unused", "error: the parameters spare.weight, spare.bias of model 'model' got no gradient in the first training "
     "step, so DDP cannot all-reduce them (a layer the forward skips, a loss that ignores an output): set "
     "dist.find_unused_parameters=true, or freeze them (trainer.freeze)"),
    ("UnusedLater", "error: a model's parameters got no gradient in a training step, so DDP could not all-reduce "
     "them (a layer the forward skips, a loss that ignores an output): set dist.find_unused_parameters=true, or "
     "freeze those parameters (trainer.freeze)"),
], ids=["from-the-first-step", "from-a-later-step"])
def test_parameters_without_a_gradient_are_one_line_naming_the_setting(tmp_path: Path, model: str, message: str):
    (tmp_path / "forkunused.py").write_text(UNUSED)
    args = ["model=mlp", f"model._target_=forkunused.{model}", "~model.hidden_sizes", "~model.dropout",
            "trainer.max_steps=3", "trainer.progress=false", "hydra.run.dir=run"]
    refused = torchrun(2, args, tmp_path, env={"PYTHONPATH": str(tmp_path)})
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode != 0 and errors, refused.stderr[-3000:]
    assert "find_unused_parameters=True" not in refused.stderr  # torch's own words: a page of traceback
    assert all(line == message for line in errors), errors
    allowed = check(torchrun(2, [*args, "dist.find_unused_parameters=true", "hydra.run.dir=allowed"], tmp_path,
                             env={"PYTHONPATH": str(tmp_path)}))
    assert "stopped at step 3" in allowed.stdout + allowed.stderr
