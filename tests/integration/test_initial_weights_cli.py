"""dist=fsdp starts from the weights the model's own code gives, as dist=ddp does, on any world size, through the
real command line (src/loop/initial_weights.py):

- models that declare no initialisation hook (a zero-initialised head; nanoGPT's `self.apply(self._init_weights)`
  with a per-name rescale): their constructor's weights, `torch.manual_seed(seed); Model()` bit for bit, under
  ddp and fsdp alike, with one log line under fsdp saying what to add to build on the meta device;
- models that declare one (a per-name rule in `init_module(module, name)`, a model-level `init_weights()`, and the
  built-in models): built on the meta device under both strategies, to the same weights on 1, 2 and 3 ranks;
- init_from's whole weights (the 2-rank ddp run's) loaded into the shards of a model built on the meta device.

The fork's models are a module of its own (PYTHONPATH), each an option of the `model` group in the test's conf/.
Initial weights are read from a checkpoint after one SGD step at lr=0 (the step changes no parameter; BatchNorm's
running statistics, which see each rank's batches, are left out). The runs on as many processes share a launch
(LazyRuns).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import check, torchrun
from lazy_runs import LazyRuns

from src import checkpoint

pytestmark = pytest.mark.slow

FORK = '''
import math
import torch
from torch import nn


class ZeroHead(nn.Module):
    def __init__(self, in_features, num_outputs):
        super().__init__()
        self.body = nn.Linear(in_features, 32)
        self.head = nn.Linear(32, num_outputs)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x):
        return self.head(torch.relu(self.body(x.flatten(1))))


class NanoStyle(nn.Module):
    def __init__(self, in_features, num_outputs, layers=2):
        super().__init__()
        self.embed = nn.Linear(in_features, 16)
        self.blocks = nn.ModuleList(nn.ModuleDict({"c_fc": nn.Linear(16, 64), "c_proj": nn.Linear(64, 16)})
                                    for _ in range(layers))
        self.head = nn.Linear(16, num_outputs)
        self.apply(self._init_weights)
        for name, parameter in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)

    def forward(self, x):
        x = self.embed(x.flatten(1))
        for block in self.blocks:
            x = x + block["c_proj"](torch.relu(block["c_fc"](x)))
        return self.head(x)


class PerName(NanoStyle):
    """The same model, initialised by a hook: built on the meta device."""

    def __init__(self, in_features, num_outputs, layers=2):
        nn.Module.__init__(self)
        self.layers = layers
        self.embed = nn.Linear(in_features, 16)
        self.blocks = nn.ModuleList(nn.ModuleDict({"c_fc": nn.Linear(16, 64), "c_proj": nn.Linear(64, 16)})
                                    for _ in range(layers))
        self.head = nn.Linear(16, num_outputs)

    def init_module(self, module, name):
        std = 0.02 / math.sqrt(2 * self.layers) if name.endswith("c_proj") else 0.02
        nn.init.normal_(module.weight, std=std)
        nn.init.zeros_(module.bias)


class Tied(PerName):
    """A weight tied across two layers (a GPT's embedding and head): one parameter, on meta as built whole."""

    def __init__(self, in_features, num_outputs, layers=2):
        super().__init__(in_features, num_outputs, layers)
        self.blocks[1]["c_fc"].weight = self.blocks[0]["c_fc"].weight


class WholeInit(ZeroHead):
    """torchtitan's way: one init_weights() for the model."""

    def __init__(self, in_features, num_outputs):
        nn.Module.__init__(self)
        self.body = nn.Linear(in_features, 32)
        self.head = nn.Linear(32, num_outputs)

    def init_weights(self):
        nn.init.trunc_normal_(self.body.weight, std=0.5)
        nn.init.zeros_(self.body.bias)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
'''
FIRST_STEP = ["optimizer=sgd", "optimizer.lr=0", "scheduler=constant", "trainer.max_steps=1", "dataset.batch_size=48",
              "trainer.progress=false", "trainer.limit_val_batches=1"]
FSDP = ["dist=fsdp", "dist.fsdp.min_unit_params=0"]  # every child that holds parameters sharded as a unit


MODELS = ["ZeroHead", "NanoStyle", "PerName", "WholeInit", "Tied"]
CNN = ["model=cnn"]
RUNS: dict[str, tuple[int, list[str]]] = {  # name: (processes, overrides)
    **{f"{model}_one": (1, [f"model={model}"]) for model in ("PerName", "WholeInit", "Tied")},
    **{f"{model}_ddp": (2, [f"model={model}"]) for model in MODELS},
    **{f"{model}_fsdp": (3, [f"model={model}", *FSDP]) for model in MODELS},
    "cnn_one": (1, CNN), "cnn_ddp": (2, CNN), "cnn_fsdp_2": (2, [*CNN, *FSDP]), "cnn_fsdp_3": (3, [*CNN, *FSDP]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> LazyRuns:
    """The runs of RUNS (LazyRuns); the fork's models are options of the `model` group in its conf/."""
    root = tmp_path_factory.mktemp("initial_weights")
    (root / "forkmodels.py").write_text(FORK)
    (root / "conf" / "model").mkdir(parents=True)
    for model in MODELS:
        (root / "conf" / "model" / f"{model}.yaml").write_text(
            f"_target_: forkmodels.{model}\nin_features: ${{data:num_features}}\nnum_outputs: ${{data:num_outputs}}\n")
    return LazyRuns(root, {name: (processes, [*FIRST_STEP, *args]) for name, (processes, args) in RUNS.items()},
                    env={"PYTHONPATH": str(root)})


def started(runs: LazyRuns, name: str) -> dict[str, torch.Tensor]:
    """The parameters run `name` starts from (no buffers)."""
    return parameters(runs(name))


def parameters(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model's parameters (no buffers) in the run's newest checkpoint, of either format."""
    path = run_dir / "checkpoints"
    saved = checkpoint.read(path / "last.pt" if (path / "last.pt").exists() else path / "last").model_weights()
    return {key: value for key, value in saved.items() if "running_" not in key and "num_batches" not in key}


def constructed(workdir: Path, name: str) -> dict[str, torch.Tensor]:
    sys.path.insert(0, str(workdir))
    try:
        import forkmodels
    finally:
        sys.path.remove(str(workdir))
    torch.manual_seed(0)
    return dict(getattr(forkmodels, name)(in_features=64, num_outputs=10).named_parameters())


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.parametrize("model", ["ZeroHead", "NanoStyle"])
def test_a_model_without_a_hook_starts_from_its_constructor_s_weights_under_ddp_and_fsdp(runs: LazyRuns, model: str):
    ddp, fsdp = started(runs, f"{model}_ddp"), started(runs, f"{model}_fsdp")
    assert_same(ddp, constructed(runs.root, model))
    assert_same(fsdp, ddp)
    if model == "ZeroHead":
        assert ddp["head.weight"].abs().sum() == 0 and ddp["head.bias"].abs().sum() == 0
    else:
        assert ddp["blocks.0.c_proj.weight"].std().item() == pytest.approx(0.01, rel=0.2)
    log = (runs(f"{model}_fsdp") / "train.log").read_text()
    assert (f"dist=fsdp: the model ({model}) is built whole on every rank, then sharded: it declares no "
            "init_module(module, name) or init_weights(); give it one to build it on the meta device") in log


@pytest.mark.parametrize("model", ["PerName", "WholeInit", "Tied"])
def test_a_model_with_a_hook_is_built_on_meta_to_the_same_weights_on_any_world_size(runs: LazyRuns, model: str):
    one, ddp, fsdp = (started(runs, f"{model}_{kind}") for kind in ("one", "ddp", "fsdp"))
    assert_same(one, ddp)
    assert_same(fsdp, ddp)
    if model == "WholeInit":
        assert ddp["head.weight"].abs().sum() == 0 and ddp["body.weight"].std().item() == pytest.approx(0.5, rel=0.1)
    else:
        assert ddp["blocks.1.c_proj.weight"].std().item() == pytest.approx(0.01, rel=0.2)
        assert ddp["blocks.1.c_fc.weight"].std().item() == pytest.approx(0.02, rel=0.2)
    if model == "Tied":  # one tensor on every strategy, even where dist.fsdp.min_unit_params=0 makes units of both
        assert torch.equal(ddp["blocks.0.c_fc.weight"], ddp["blocks.1.c_fc.weight"])
        for run in ("Tied_one", "Tied_ddp", "Tied_fsdp"):
            assert f"Tied ({5_466 - 64 * 16:,} parameters" in (runs(run) / "train.log").read_text()
    hook = "init_weights" if model == "WholeInit" else "init_module"
    for run in (f"{model}_ddp", f"{model}_fsdp"):
        assert f"the model is built on the meta device; its {hook} gives it its weights" in (
            runs(run) / "train.log").read_text()


def test_the_built_in_models_start_from_their_constructor_s_weights_on_one_two_and_three_ranks_of_either_strategy(
        runs: LazyRuns):
    one = started(runs, "cnn_one")
    for name in ("cnn_ddp", "cnn_fsdp_2", "cnn_fsdp_3"):
        assert_same(started(runs, name), one)
    from src.components.models import SimpleCNN

    torch.manual_seed(0)  # built on meta, the CNN starts from its constructor's weights, as every run did before
    assert_same(one, dict(SimpleCNN(in_channels=1, image_size=(8, 8), num_outputs=10).named_parameters()))
    fan_in = one["classifier.5.weight"].shape[1]  # torch's Linear: uniform within 1/sqrt(fan_in)
    assert one["classifier.5.weight"].abs().max().item() <= 1 / math.sqrt(fan_in)


def test_init_from_loads_a_ddp_checkpoint_into_the_shards_of_a_model_built_on_meta(runs: LazyRuns, tmp_path: Path):
    """Seed 1 would draw other weights: every parameter is the file's (the ddp run's, seed 0)."""
    source = runs("cnn_ddp") / "checkpoints" / "last.pt"
    check(torchrun(2, [*FIRST_STEP, *CNN, *FSDP, "seed=1", f"init_from={source}", "hydra.run.dir=run"], tmp_path))
    assert_same(parameters(tmp_path / "run"), started(runs, "cnn_ddp"))
    log = (tmp_path / "run" / "train.log").read_text()
    assert "init_from: loaded 16 of the model's 16 tensors" in log
    assert "the model is built on the meta device; its init_module gives it its weights, each rank its shards" in log
