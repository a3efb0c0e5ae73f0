"""The primitives a task's training step is given (src/loop/step.py): per-sample draws keyed by the sample's place
in the global batch, the gradient of all_gather across ranks, each optimizer's update with the callbacks'
on_before_optimizer_step, and what the trainer refuses of a step. The loop around them: test_trainer.py; the
recipes built on them through the CLI: tests/integration/test_recipes_cli.py."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from src.common.errors import UsageError
from src.components.tasks import Classification
from src.loop.callback import Callback, Callbacks, Update
from src.loop.step import MetricSums, Samples, StepContext
from src.loop.task import Task
from src.recipes.simclr import SimCLR


def context(models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer], rank: int = 0,
            world_size: int = 1, micro_batch_size: int = 4, grad_clip: float | None = None,
            callbacks: Callbacks | None = None, scaler: torch.amp.GradScaler | None = None) -> StepContext:
    callbacks = callbacks or Callbacks()
    return StepContext(models, models, optimizers, {}, scaler or torch.amp.GradScaler("cpu", enabled=False),
                       MetricSums({}, torch.device("cpu")), torch.device("cpu"), None, rank, world_size,
                       micro_batch_size, 7, grad_clip, callbacks.before_optimizer_step)


# -- per-sample draws -------------------------------------------------------------------------------------------


def test_a_sample_draws_the_same_wherever_its_micro_batch_lands():
    """Global batch 8: one process with 2 micro-steps of 4, or 2 ranks with 1 micro-step of 4 each, or 2 ranks
    with 2 micro-steps of 2: sample p of the step draws the same row."""
    model = {"model": nn.Linear(1, 1)}
    one = context(model, {}, micro_batch_size=8)
    one.begin([], number=3)
    whole = next(one.accumulate([None]))[0].randn("latent", 5)
    assert whole.shape == (8, 5)
    for world, micro, accum in ((2, 4, 1), (1, 4, 2), (2, 2, 2)):
        rows = {}
        for rank in range(world):
            step = context(model, {}, rank=rank, world_size=world, micro_batch_size=micro)
            step.begin([], number=3)
            for draws, _ in step.accumulate([None] * accum):
                for position, row in zip(draws.positions.tolist(), draws.randn("latent", 5)):
                    rows[position] = row
        assert sorted(rows) == list(range(8))
        assert torch.equal(torch.stack([rows[p] for p in range(8)]), whole), (world, micro, accum)
    other_step = context(model, {}, micro_batch_size=8)
    other_step.begin([], number=4)
    assert not torch.equal(next(other_step.accumulate([None]))[0].randn("latent", 5), whole)  # a new step, new noise


def test_streams_and_seeds_draw_apart_and_uniforms_stay_in_range():
    positions = torch.arange(1000)
    normal = Samples(0, 1, positions).randn("a", 4)
    assert abs(normal.mean().item()) < 0.05 and abs(normal.std().item() - 1) < 0.05
    assert not torch.equal(normal, Samples(0, 1, positions).randn("b", 4))
    assert not torch.equal(normal, Samples(1, 1, positions).randn("a", 4))
    uniform = Samples(0, 1, positions).rand("a", 3)
    assert 0 < uniform.min() and uniform.max() < 1 and abs(uniform.mean().item() - 0.5) < 0.02


# -- gathering across ranks ---------------------------------------------------------------------------------------


def _gather_worker(rank: int, store: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    whole = torch.randn(6, 3)  # the global batch's rows; rank r holds rows 3r .. 3r + 2
    weights = torch.randn(6, 3)
    mine = whole[3 * rank:3 * rank + 3].clone().requires_grad_(True)
    step = context({"model": nn.Linear(1, 1)}, {}, rank=rank, world_size=2, micro_batch_size=3)
    gathered = step.all_gather(mine)
    # A loss over the global batch, summed over this rank's anchors: rank r's share of one global sum.
    (gathered * weights).sum(dim=1).square()[3 * rank:3 * rank + 3].sum().backward()
    torch.save({"gathered": gathered.detach(), "grad": mine.grad}, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_all_gather_orders_rows_by_rank_and_sends_each_rank_its_rows_gradient(tmp_path: Path):
    mp.spawn(_gather_worker, args=(str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2)
    torch.manual_seed(0)
    whole, weights = torch.randn(6, 3).requires_grad_(True), torch.randn(6, 3)
    (whole * weights).sum(dim=1).square().sum().backward()  # the same loss in one process
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(result["gathered"], whole.detach())
        assert torch.allclose(result["grad"], whole.grad[3 * rank:3 * rank + 3], rtol=0, atol=1e-6)


# -- an update ----------------------------------------------------------------------------------------------------


class Recorder(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, str, float]] = []

    def on_before_optimizer_step(self, update: Update) -> None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in update.module.parameters()]).item()
        self.seen.append((update.number, update.name, norm))


def test_each_update_shows_the_callbacks_unscaled_gradients_before_clipping():
    torch.manual_seed(0)
    first, second = nn.Linear(3, 2), nn.Linear(3, 2)
    optimizers = {"first": torch.optim.SGD(first.parameters(), lr=0.1),
                  "second": torch.optim.SGD(second.parameters(), lr=0.1)}
    recorder = Recorder()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    step = context({"first": first, "second": second}, optimizers, grad_clip=1e-3, scaler=scaler,
                   callbacks=Callbacks({"recorder": recorder}))
    x = torch.randn(4, 3)
    expected = torch.autograd.grad((first(x) * 100).sum(), list(first.parameters()))
    true_norm = torch.nn.utils.get_total_norm(list(expected)).item()
    step.begin([], number=1)
    for _, _ in step.accumulate([None]):
        step.backward((first(x) * 100).sum() + second(x).sum(), step.divisor([1]))
    before = first.weight.detach().clone()
    step.optimizer_step("first")
    assert recorder.seen == [(1, "first", pytest.approx(true_norm, rel=1e-5))]  # unscaled: not x1024
    assert true_norm > 1e-3 and (first.weight - before).norm() <= 0.1 * 1e-3 * 1.0001  # clipped after the callback
    assert all(p.grad is None for p in first.parameters()) and step.updated == ["first"]
    step.optimizer_step("second")
    assert [name for _, name, _ in recorder.seen] == ["first", "second"]


class Idle(Task):
    """A step that updates nothing: a forgotten `step.optimizer_step`."""

    def train_step(self, step: StepContext) -> None:
        for _, batch in step.accumulate(step.batches):
            step.backward(step.models["model"](batch[0]).sum(), step.divisor([len(batch[0])]))


def test_a_step_that_updates_no_model_is_one_line(tmp_path: Path):
    from test_trainer import one_process_trainer

    trainer = one_process_trainer(tmp_path, Idle())
    with pytest.raises(UsageError, match="^Idle.train_step updated no model: call step.optimizer_step"):
        trainer.fit(__import__("src.loop.trainer", fromlist=["TrainState"]).TrainState())


class PlainBackward(Task):
    """A step that calls loss.backward() itself: no share of the global mean, nothing for the NaN watch."""

    def train_step(self, step: StepContext) -> None:
        for _, batch in step.accumulate(step.batches):
            step.models["model"](batch[0]).sum().backward()
        step.optimizer_step("model")


class Uncounted(Task):
    """A step that adds its loss but not the count the metrics divide by."""

    def train_step(self, step: StepContext) -> None:
        for _, batch in step.accumulate(step.batches):
            loss_sum = step.models["model"](batch[0]).sum()
            step.backward(loss_sum, step.divisor([len(batch[0])]))
            step.add_sums({"loss": loss_sum.detach()})
        step.optimizer_step("model")


class Misspelt(Task):
    """A step that adds a sum under a name its task does not declare (`recn` for `recon`)."""

    def train_step(self, step: StepContext) -> None:
        for _, batch in step.accumulate(step.batches):
            loss_sum = step.models["model"](batch[0]).sum()
            step.backward(loss_sum, step.divisor([len(batch[0])]))
            step.add_sums({"loss": loss_sum.detach(), "count": len(batch[0]), "recn": loss_sum.detach()})
        step.optimizer_step("model")


@pytest.mark.parametrize("task, message", [
    (PlainBackward(), r"^PlainBackward.train_step back-propagated no loss through step.backward\(loss_sum, "
                      r"step.divisor\(counts\)\): call it instead of loss.backward\(\)$"),
    (Uncounted(), r"^Uncounted.train_step added no count: give step.add_sums the units its losses sum over, "
                  r"\{'count': N, ...\}: every metric divides by it$"),
    (Misspelt(), r"^the sum 'recn' is not one the task declares \(loss, count\): name it in the task's sum_shapes "
                 r"\(val_sum_shapes for a sum counted on val only\)$"),
], ids=["loss.backward()", "no count", "undeclared sum"])
def test_a_step_that_back_propagates_around_step_backward_or_counts_nothing_is_one_line(tmp_path: Path, task, message):
    from test_trainer import one_process_trainer

    trainer = one_process_trainer(tmp_path, task)
    with pytest.raises(UsageError, match=message):
        trainer.fit(__import__("src.loop.trainer", fromlist=["TrainState"]).TrainState())


@pytest.mark.parametrize("call", ["optimizer_step", "accumulate"])
def test_a_model_the_run_does_not_train_named_in_the_step_is_one_line(call: str):
    """Also with one micro-batch, where accumulate holds back no sync: the name is checked all the same."""
    model = nn.Linear(3, 2)
    step = context({"model": model}, {"model": torch.optim.SGD(model.parameters(), lr=0.1)})
    step.begin([], number=1)
    with pytest.raises(UsageError, match="^the step names model 'modle', which this run does not train; its models: "
                                         "model$"):
        step.optimizer_step("modle") if call == "optimizer_step" else next(step.accumulate([None], ["modle"]))


def test_a_model_whose_optimizer_never_steps_is_warned_about_once(tmp_path: Path, caplog):
    """A second model the step forgets (only the first step's "updated no model" is an error: a schedule may update
    a model every k steps)."""
    from test_trainer import one_process_trainer

    trainer = one_process_trainer(tmp_path, Classification())  # steps "model" alone
    trainer.config = dataclasses.replace(trainer.config, epochs=2)
    trainer.parts.optimizers["critic"] = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="src.loop.trainer"):
        trainer.fit(__import__("src.loop.trainer", fromlist=["TrainState"]).TrainState())
    assert [record.getMessage() for record in caplog.records if "optimizer step" in record.getMessage()] == [
        "model critic took no optimizer step in epoch 1: train_step never called step.optimizer_step('critic'), so "
        "it does not train (its schedule steps all the same)"]


def test_the_built_in_step_is_written_with_the_same_primitives():
    """Classification's step is Task.train_step itself: one path for the built-in tasks and a fork's."""
    assert Classification.train_step is Task.train_step and Classification().feeds_batches


# -- a recipe's step built on them --------------------------------------------------------------------------------


def test_simclr_accumulating_micro_batches_steps_on_the_global_loss_of_the_embeddings_it_back_propagates():
    """src/recipes/simclr.py under trainer.grad_accum=2: embedded first without gradients, then again with them, each
    micro-batch takes the update of NT-Xent over both micro-batches' views, made by the same dropout masks, and
    BatchNorm counts each micro-batch once, as one pass with gradients over each does."""
    def encoder() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Linear(16, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Dropout(0.5),
                             nn.Linear(12, 6))

    task, images = SimCLR(embedding_size=6), torch.randn(8, 1, 4, 4)
    micro_batches = [(images[:4], torch.zeros(4)), (images[4:], torch.zeros(4))]
    expected = encoder()
    torch.manual_seed(1)  # the dropout masks: drawn in the same order by both
    views = [task.embed_views(context({}, {}), expected, batch, Samples(7, 1, torch.arange(4) + 4 * index))
             for index, (batch, _) in enumerate(micro_batches)]
    first, second = (torch.cat(embedded) for embedded in zip(*views))
    (task.nt_xent(first, second, first, second, 0) / 8).backward()

    model = encoder()
    step = context({"model": model}, {"model": torch.optim.SGD(model.parameters(), lr=1.0)})
    torch.manual_seed(1)
    step.begin(micro_batches, number=1)
    before = {name: value.detach().clone() for name, value in model.named_parameters()}
    task.train_step(step)
    for name, value in model.named_parameters():
        torch.testing.assert_close(before[name] - value.detach(), dict(expected.named_parameters())[name].grad)
    assert model[2].num_batches_tracked.item() == expected[2].num_batches_tracked.item() == 2
    torch.testing.assert_close(model[2].running_var, expected[2].running_var)
