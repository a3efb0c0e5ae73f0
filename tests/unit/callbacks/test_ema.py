"""EMA weights (src/callbacks/ema.py): the update's math, its place in the loop, its checkpoint and its settings.
The command-line claims (2 ranks = 1 process, bitwise resume, eval.py weights=ema) are in
tests/integration/test_ema_cli.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from one_model import one_model_parts
from torch import nn

from src import checkpoint
from src.callbacks.ema import EMA, EmaWeights
from src.checkpoint.file_store import FileStore
from src.common.errors import UsageError
from src.components.tasks import Classification
from src.config import building, schema
from src.config.schema import TrainerConfig
from src.data.loaders import Data, TensorBatchLoader
from src.data.splits import DataSplits
from src.loop import trainer as loop
from src.loop.callback import Callbacks
from src.loop.task_and_model import check_task
from src.loop.trainer import Trainer, TrainParts, TrainState
from src.parallel import job  # noqa: F401 - registers ${data:} ... as train.py does
from src.parallel.distributed import DistEnv, Runtime
from src.reports.reporting import Reporter

CONF = Path(__file__).resolve().parents[3] / "conf"


def model_with_batchnorm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))


def train_a_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model.train()
    loss = model(torch.randn(16, 4)).square().mean()  # moves the BatchNorm running statistics too
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


# -- the update -----------------------------------------------------------------------------------


def test_the_update_averages_parameters_and_copies_buffers():
    model = model_with_batchnorm()
    ema = EmaWeights(model, decay=0.9)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    for step in (1, 2, 3):
        train_a_step(model, optimizer)
        ema.update(step)
        for name, p in model.named_parameters():
            expected[name] = 0.9 * expected[name] + 0.1 * p.detach()
    ema_state, live_state = ema.state_dict(), model.state_dict()
    assert ema_state.keys() == live_state.keys()  # saved and loaded like the model
    for name, _ in model.named_parameters():
        assert torch.allclose(ema_state[name], expected[name], rtol=0, atol=1e-6), name
        assert not torch.equal(ema_state[name], live_state[name]), name
    for name, _ in model.named_buffers():  # running_mean, running_var, num_batches_tracked: copied
        assert torch.equal(ema_state[name], live_state[name]), name
    assert int(ema_state["1.num_batches_tracked"]) == 3
    assert not any(average.requires_grad for average in ema.average.values())


def test_a_tied_weight_s_average_is_saved_under_each_of_its_names():
    """What eval.py weights=ema loads: the model's tensors, then the EMA's over them (Checkpoint.model_weights); a
    name of the tied weight left out would load the live weight over its average."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    model[2].weight = model[0].weight
    ema = EmaWeights(model, decay=0.9)
    train_a_step(model, torch.optim.SGD(model.parameters(), lr=0.5))
    ema.update(1)
    ema_state, live_state = ema.state_dict(), model.state_dict()
    assert ema_state.keys() == live_state.keys() and ema_state["2.weight"] is ema_state["0.weight"]
    tied = copy.deepcopy(model)
    tied.load_state_dict({**live_state, **ema_state})
    assert torch.equal(tied[2].weight, ema.average["0.weight"])
    assert not torch.equal(tied[2].weight, model[2].weight)


def test_warmup_ramps_the_decay_linearly():
    ema = EmaWeights(nn.Linear(2, 2), decay=0.9, warmup_steps=10)
    assert [ema.decay_at(step) for step in (1, 5, 10, 11, 1000)] == pytest.approx([0.09, 0.45, 0.9, 0.9, 0.9])
    assert EmaWeights(nn.Linear(2, 2), decay=0.9).decay_at(1) == 0.9  # warmup_steps=0: the decay from step 1


def test_the_update_never_reads_a_value_on_the_host():
    """Meta tensors have shapes but no values: `.item()`, `bool()` or a copy to the host would raise,
    so an update that runs on them syncs nothing (on a GPU, nothing waits for the device)."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    ema = EmaWeights(model, decay=0.99, warmup_steps=3)
    for step in (1, 2, 3, 4):
        ema.update(step)
    assert all(average.is_meta for average in ema.average.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to see host syncs")
def test_the_update_does_not_sync_with_the_gpu():
    model = model_with_batchnorm().cuda()
    ema = EmaWeights(model, decay=0.99, warmup_steps=3)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in (1, 2, 3, 4):
            ema.update(step)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# -- in the loop ----------------------------------------------------------------------------------

SAMPLES, BATCH = 48, 8


def tiny_parts(tmp_path: Path, model: nn.Module, grad_accum: int = 1, callbacks: Callbacks | None = None) -> TrainParts:
    from src.data.loaders import GlobalBatchSampler
    from src.data.splits import DataSplits

    tmp_path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1)
    dataset = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 4), torch.randint(0, 3, (SAMPLES,)))
    sampler = GlobalBatchSampler(SAMPLES, BATCH, rank=0, world_size=1, grad_accum=grad_accum)
    splits = DataSplits(train=dataset, val=dataset, info={"num_classes": 3, "num_features": 4})
    cpu = torch.device("cpu")
    data = Data(splits=splits, train_sampler=sampler, train_loader=TensorBatchLoader(dataset, sampler, cpu),
                val_loader=TensorBatchLoader(dataset, [list(range(SAMPLES))], cpu), num_val_samples=SAMPLES)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return one_model_parts(Runtime(DistEnv(), cpu, backend=None), Classification(), model, model, optimizer,
                           torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), data,
                           FileStore(tmp_path / "checkpoints", True), Reporter(tmp_path, True, tensorboard=False),
                           callbacks or Callbacks())


def ema_trainer(tmp_path: Path, model: nn.Module, epochs: int = 2, **config) -> Trainer:
    settings = {"monitor": "val_ema/acc", "monitor_mode": "max", **config}
    callbacks = Callbacks({"ema": EMA(decay=0.8, warmup_steps=0)})
    return Trainer(TrainerConfig(epochs=epochs, **settings),
                   tiny_parts(tmp_path, model, settings.get("grad_accum", 1), callbacks))


def ema_of(trainer: Trainer) -> EmaWeights:
    return trainer.parts.callbacks.all["ema"].weights


def resumed(trainer: Trainer, path: Path) -> TrainState:
    """`trainer` continued from the checkpoint `path` (every part restored, as Trainer.fit does: the callbacks'
    state after on_run_start built the EMA from the restored model)."""
    state = TrainState()
    saved = checkpoint.read(path)
    saved.restore({name: part for name, part in trainer.stateful(state).items() if name != "callbacks"})
    trainer.parts.callbacks.run_start(trainer_run(trainer, state))
    saved.restore({"callbacks": trainer.parts.callbacks})
    return state


def trainer_run(trainer: Trainer, state: TrainState):
    from src.loop.callback import Run

    return Run(trainer.config, trainer.parts, state, True, trainer.evaluate)


def test_the_loop_updates_once_per_optimizer_step_and_validates_the_ema_every_epoch(tmp_path: Path, monkeypatch):
    model = model_with_batchnorm()
    trainer = ema_trainer(tmp_path, model, grad_accum=2)
    updates = []
    update = EmaWeights.update
    monkeypatch.setattr(EmaWeights, "update", lambda self, step: (updates.append(step), update(self, step)))
    state = TrainState()
    trainer.fit(state)
    steps_per_epoch = SAMPLES // BATCH
    assert updates == list(range(1, 2 * steps_per_epoch + 1))  # per optimizer step, not per micro-step
    for record in state.history:
        assert {"val_ema/loss", "val_ema/acc", "val/loss", "val/acc"} <= record.keys()
    assert state.best == max(record["val_ema/acc"] for record in state.history)
    summary = json.loads((tmp_path / "metrics.json").read_text())
    assert summary["val_ema/acc"] == state.history[-1]["val_ema/acc"]
    saved = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["callbacks"]["ema"]
    model_state = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["models"]["model"]
    assert saved["best_weights"] == "ema" and saved["weights"].keys() == model_state.keys()
    for name, tensor in ema_of(trainer).state_dict().items():
        assert torch.equal(saved["weights"][name], tensor), name


def test_a_resumed_trainer_takes_the_checkpoints_ema(tmp_path: Path):
    first = ema_trainer(tmp_path / "first", model_with_batchnorm(), epochs=1)
    first.fit(TrainState())
    last = tmp_path / "first" / "checkpoints" / "last.pt"
    payload = torch.load(last, weights_only=True)
    second = ema_trainer(tmp_path / "second", model_with_batchnorm())
    resumed(second, last)
    for name, tensor in ema_of(second).state_dict().items():
        assert torch.equal(tensor, payload["callbacks"]["ema"]["weights"][name]), name
        if "weight" in name:
            assert not torch.equal(tensor, payload["models"]["model"][name]), name  # not merely the model's weights


def test_a_checkpoint_without_ema_resumes_with_the_ema_starting_from_its_model(tmp_path: Path):
    model = model_with_batchnorm()
    without = Trainer(TrainerConfig(epochs=1, monitor="val/acc", monitor_mode="max"), tiny_parts(tmp_path, model))
    without.parts.store.save(without.stateful(TrainState(epoch=1, step=6)), step=6, is_best=False)
    last = tmp_path / "checkpoints" / "last.pt"
    payload = torch.load(last, weights_only=True)
    assert payload["callbacks"] == {}
    fresh = model_with_batchnorm()
    torch.nn.init.constant_(fresh[0].weight, 0.5)  # other weights than the checkpoint's
    again = ema_trainer(tmp_path / "resumed", fresh)
    state = resumed(again, last)
    assert state.step == 6
    for name, tensor in ema_of(again).state_dict().items():
        assert torch.equal(tensor, payload["models"]["model"][name]), name


# -- reports ----------------------------------------------------------------------------------------


def test_the_epoch_record_line_and_summary_carry_val_ema():
    train = {"loss": 0.5, "acc": 0.8, "count": 100, "timed_count": 100}
    record = loop.epoch_record(1, 10, train, {"loss": 0.4, "acc": 0.85, "count": 50}, 0.1, 2.0, 1.0,
                                  loop.metric_values("val_ema", {"loss": 0.3, "acc": 0.9, "count": 50}))
    assert (record["val_ema/loss"], record["val_ema/acc"]) == (0.3, 0.9)
    line = loop.epoch_line(record, 5, 50)
    assert "val loss 0.4000 acc 0.8500  val_ema loss 0.3000 acc 0.9000 (50 samples)" in line
    assert loop.epoch_scalars(record)["val_ema/acc"] == 0.9
    assert loop.run_summary([record], 50, 1, 8, 100.0)["val_ema/acc"] == 0.9
    without = loop.epoch_record(1, 10, train, {"loss": 0.4, "acc": 0.85, "count": 50}, 0.1, 2.0, 1.0)
    assert not any(key.startswith("val_ema/") for key in without) and "val_ema" not in loop.epoch_line(
        without, 5, 50)


# -- settings ---------------------------------------------------------------------------------------


def composed(config_name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name, overrides=overrides)


def built_ema(overrides: list[str]) -> EMA:
    """The `ema` callback of the composed config, built as train.py builds it."""
    node = composed("config", overrides).callbacks.ema
    with building.errors_named("callbacks.ema", node):
        return instantiate(node)


def test_the_ema_settings_are_declared_once_and_off_by_default():
    ema = built_ema(["callbacks.ema.decay=0.999", "callbacks.ema.warmup_steps=100"])
    assert (ema.decay, ema.warmup_steps, ema.enabled) == (0.999, 100, True)
    off = built_ema([])
    assert (off.decay, off.warmup_steps, off.enabled) == (None, 0, False)


@pytest.mark.parametrize("override, message", [
    ("callbacks.ema.decay=1.5", "callbacks.ema.decay=1.5 must be in (0, 1) (or null)"),
    ("callbacks.ema.decay=0", "callbacks.ema.decay=0 must be in (0, 1) (or null)"),
    ("callbacks.ema.decay=1", "callbacks.ema.decay=1 must be in (0, 1) (or null)"),
    ("callbacks.ema.warmup_steps=-1", "callbacks.ema.warmup_steps=-1 must be at least 0"),
])
def test_bad_ema_values_are_refused_at_run_start(override, message):
    with pytest.raises(UsageError) as error:
        built_ema([override])
    assert str(error.value) == message
    built_ema(["callbacks.ema.decay=0.5", "callbacks.ema.warmup_steps=0"])


def test_eval_weights_is_model_or_ema():
    assert composed("eval", ["checkpoint=x.pt", "dataset=digits"]).weights == "model"
    schema.check_eval_config(composed("eval", ["checkpoint=x.pt", "dataset=digits", "weights=ema"]))
    with pytest.raises(UsageError, match="weights=best is not one of model, ema"):
        schema.check_eval_config(composed("eval", ["checkpoint=x.pt", "dataset=digits", "weights=best"]))


INFO = {"num_classes": 10, "num_features": 64}
SPLITS = DataSplits(train=[], val=[], info=INFO, fields=("image", "label"), target="label")
TASK = OmegaConf.create({"_target_": "src.components.tasks.Classification"})


def test_val_ema_may_be_monitored_only_with_ema_weights():
    on, off = Callbacks({"ema": EMA(0.9, 0)}), Callbacks({"ema": EMA(None, 0)})
    info = {"task": "classification"}
    check_task(instantiate(TASK), SPLITS, info, "val_ema/acc", on.metric_splits, on.enable_hints())
    with pytest.raises(UsageError) as error:
        check_task(instantiate(TASK), SPLITS, info, "val_ema/acc", off.metric_splits, off.enable_hints())
    assert str(error.value) == ("trainer.monitor=val_ema/acc needs EMA weights: set callbacks.ema.decay (e.g. 0.999), "
                                "or monitor val/acc")
    with pytest.raises(UsageError, match="choose one of val/loss, val/acc, val_ema/loss, val_ema/acc, train/loss"):
        check_task(instantiate(TASK), SPLITS, info, "val_ema/f1", on.metric_splits, on.enable_hints())
