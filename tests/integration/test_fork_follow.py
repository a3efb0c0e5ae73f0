"""A fork that follows the guide (docs/forking.md) keeps `make test` green and "1 GPU to 8 gives the same model":
the repo is copied to a temp dir, the guide's recipes go where it says (src/components/ and conf/): a model whose
`forward` is 60 lines, the guide's dataset, task and model (mine.py; made the default run in conf/config.yaml), and a
task with a training step of its own; the fork-facing suite (`-m "not slow and not template"`) passes there; and each
recipe trains the same weights on 1 process and on 2 ranks at the same global batch (SGD). A biased conv feeding
BatchNorm, the trap the guide names, is warned about on 2 ranks."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, run, weights
from lazy_runs import LazyRuns
from test_fork import readme_files

pytestmark = [pytest.mark.slow, pytest.mark.template]  # it copies this template's own tree and guide

FORWARD_LINES = 60

# A model with a long, unrolled forward: the layout test's 40-line rule is the machinery's, not the fork's.
LONG_NET = '''import torch
from torch import nn


class LongNet(nn.Module):
    """Stages of a linear layer, a tanh and a small residual step, written out one per line."""

    def __init__(self, in_features: int, num_outputs: int, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(in_features, width)
        self.stages = nn.ModuleList(nn.Linear(width, width) for _ in range(STAGES))
        self.out = nn.Linear(width, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x.flatten(1)))
BODY        return self.out(h)


class BiasedNet(nn.Module):
    """The trap: a conv with a bias straight into BatchNorm."""

    def __init__(self, in_channels: int, num_outputs: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))
'''

# A training step of the fork's own, written with the step primitives the guide lists: each image blended with its
# mirror image by a weight drawn per sample (a draw keyed by the sample, so the same on any world size).
MIXUP = '''import torch

from src.components.tasks import Classification


class MirrorMix(Classification):
    """Each image blended with its left-right mirror by a weight drawn per sample."""

    def train_step(self, step) -> None:
        model = step.models[self.output_model]
        batches = [self.split(batch) for batch in step.batches]
        divisor = step.divisor([self.count(batch.target) for batch in batches])
        for micro, batch in step.accumulate(batches, [self.output_model]):
            images, target = batch.args[0], batch.target
            weight = micro.rand("mirror", 1).view(-1, *[1] * (images.dim() - 1))
            with step.autocast():
                logits = model(weight * images + (1 - weight) * images.flip(-1)).float()
            loss_sum = torch.nn.functional.cross_entropy(logits, target, reduction="sum")
            step.backward(loss_sum, divisor)
            step.add_sums(self.batch_sums(logits, target, loss_sum, divisor.counts[micro.index]))
        step.optimizer_step(self.output_model)
'''


def long_net_source() -> str:
    """LONG_NET with a forward of exactly FORWARD_LINES lines."""
    stages = FORWARD_LINES - 3  # the def line, the first and the return line
    body = "".join(f"        h = h + 0.05 * torch.tanh(self.stages[{index}](h))\n" for index in range(stages))
    return LONG_NET.replace("STAGES", str(stages)).replace("BODY", body)


def fork_files() -> dict[str, str]:
    """What a forker adds, by path in the repo."""
    guide = readme_files()
    files = {"src/components/long_net.py": long_net_source(), "src/components/mixup.py": MIXUP,
             "src/components/mine.py": guide["mine.py"]}
    for path in ("conf/task/tolerance.yaml", "conf/model/masked_net.yaml", "conf/dataset/masked_scenes.yaml"):
        files[path] = guide[path].replace("_target_: mine.", "_target_: src.components.mine.")
    files["conf/model/long_net.yaml"] = ("# A long unrolled MLP (the fork's).\n"
                                         "_target_: src.components.long_net.LongNet\n"
                                         "in_features: ${data:num_features}  # from the dataset\n"
                                         "num_outputs: ${data:num_outputs}   # from the task\n"
                                         "width: 32                          # hidden width\n")
    files["conf/model/biased_net.yaml"] = ("# A conv with a bias before BatchNorm (the trap the guide names).\n"
                                           "_target_: src.components.long_net.BiasedNet\n"
                                           "in_channels: ${data:in_channels}  # from the dataset\n"
                                           "num_outputs: ${data:num_outputs}  # from the task\n")
    files["conf/task/mixup.yaml"] = (REPO / "conf" / "task" / "classification.yaml").read_text().replace(
        "_target_: src.components.tasks.Classification", "_target_: src.components.mixup.MirrorMix")
    config = (REPO / "conf" / "config.yaml").read_text()  # the guide's fork made the default run, as the guide says
    for group, option in (("task", "tolerance"), ("model", "masked_net"), ("dataset", "masked_scenes")):
        config, count = re.subn(rf"^  - {group}: \w+", f"  - {group}: {option}", config, flags=re.MULTILINE)
        assert count == 1, group
    files["conf/config.yaml"] = config
    return files


@pytest.fixture(scope="module")
def fork(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fork") / "repo"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.splitlines()
    for path in listed:
        if (REPO / path).is_file():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / path, root / path)
    for path, text in fork_files().items():
        (root / path).write_text(text)
    return root


def test_the_fork_s_forward_is_as_long_as_the_guide_allows():
    source = long_net_source()
    forward = source[source.index("    def forward"):source.index("class BiasedNet")].rstrip().splitlines()
    assert len(forward) == FORWARD_LINES


@pytest.mark.timeout(960)  # its command may take run()'s 900 s; then its output is the report
def test_the_fork_facing_suite_passes_in_the_fork(fork: Path):
    # One process (-n 0): the suite's own workers keep both cores busy; a second worker here would only import and
    # collect everything again.
    result = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-m",
                  "not slow and not template"], fork, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:]
    assert " passed" in result.stdout.splitlines()[-1]


SGD = ["optimizer=sgd", "optimizer.lr=0.05", "optimizer.momentum=0.9", "scheduler=constant", "trainer.epochs=2",
       "trainer.log_every_steps=5"]
RECIPES = {
    "long_net": ["task=classification", "model=long_net", "dataset=digits"],
    "mine": ["dataset.batch_size=32"],  # the fork's default run: task=tolerance model=masked_net dataset=masked_scenes
    "mixup": ["task=mixup", "model=mlp", "dataset=digits"],
}


BIASED = ["task=classification", "model=biased_net", "dataset=synthetic", "dataset.image_size=[8,8]",
          "trainer.epochs=1"]


@pytest.fixture(scope="module")
def runs(fork: Path) -> LazyRuns:
    """Each recipe on 1 process and on 2 ranks, and the biased model on 2 ranks, trained by the fork's train.py
    (LazyRuns: the runs on as many processes share a launch)."""
    recipes = {f"{recipe} {processes}": (processes, [*args, *SGD]) for recipe, args in RECIPES.items()
               for processes in (1, 2)}
    return LazyRuns(fork / "runs", {**recipes, "biased": (2, BIASED)}, script=str(fork / "train.py"))


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_each_recipe_trains_the_same_weights_on_one_process_and_two_ranks(runs: LazyRuns, recipe: str):
    one, two = weights(runs(f"{recipe} 1")), weights(runs(f"{recipe} 2"))
    assert one.keys() == two.keys()
    for name, tensor in one.items():
        torch.testing.assert_close(two[name], tensor, rtol=0, atol=1e-5, msg=name)
    assert "has a bias feeding the BatchNorm" not in (runs(f"{recipe} 2") / "train.log").read_text()


def test_a_bias_feeding_batchnorm_is_warned_about_on_two_ranks(runs: LazyRuns):
    log = (runs("biased") / "train.log").read_text()
    assert "conv has a bias feeding the BatchNorm bn directly" in log
