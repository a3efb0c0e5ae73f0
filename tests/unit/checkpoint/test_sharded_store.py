"""Sharded checkpoint directories (src/checkpoint/sharded_store.py) in one process (DCP runs without a process
group): the layout, the pointers, pruning, what counts as complete, and reading the tensors back. Several
ranks: tests/integration/test_fsdp_cli.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from src import checkpoint
from src.checkpoint import layout
from src.checkpoint.sharded_store import ShardedStore
from src.checkpoint.states import ModelState, Named, OptimizerState
from src.checkpoint.store import FORMAT
from src.common.errors import UsageError


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def parts(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Named]:
    return {"models": Named({"model": ModelState(model)}, "model"),
            "optimizers": Named({"model": OptimizerState(model, optimizer)}, "optimizer")}


def save(checkpointer: ShardedStore, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
         is_best: bool) -> None:
    checkpointer.save({**parts(model, optimizer), "scheduler": {}, "loop": {"step": step, "epoch": 0}, "config": {}},
                      step, is_best=is_best)


def tensors_in(state) -> list:
    if isinstance(state, torch.Tensor):
        return [state]
    values = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else []
    return [tensor for value in values for tensor in tensors_in(value)]


@pytest.fixture
def saved(tmp_path: Path) -> ShardedStore:
    """Steps 5 (best), 10 and 15 saved with keep_last=1."""
    checkpointer = ShardedStore(tmp_path / "checkpoints", is_main_process=True, keep_last=1)
    model, optimizer = trained(0)
    for step, is_best in ((5, True), (10, False), (15, False)):
        save(checkpointer, model, optimizer, step, is_best)
    return checkpointer


def test_a_save_is_a_directory_named_by_step_and_last_and_best_name_directories(saved: ShardedStore):
    directory = saved.directory
    assert sorted(path.name for path in directory.iterdir()) == ["best", "last", "step_000000005", "step_000000015"]
    assert (directory / "last").read_text() == "step_000000015" and (directory / "best").read_text() == "step_000000005"
    assert sorted(path.name for path in (directory / "step_000000015").iterdir()) == [
        ".metadata", "__0_0.distcp", "state.pt"]
    state = torch.load(directory / "step_000000015" / "state.pt", weights_only=True)
    assert state["format"] == FORMAT and state["loop"]["step"] == 15
    assert tensors_in(state) == []  # every tensor is in the shards: the model's and the optimizer's
    assert set(state["models"]["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert set(state["optimizers"]["model"]) == {"state", "param_groups"}


def test_a_sharded_checkpoint_named_with_pt_is_named_without_it(saved: ShardedStore):
    """`best.pt` where a dist=fsdp run wrote `best` (a recipe's `aux.teacher.path=.../best.pt` after an fsdp run)."""
    with pytest.raises(UsageError) as error:
        checkpoint.read(saved.directory / "best.pt")
    assert str(error.value) == (f"checkpoint {saved.directory / 'best.pt'} does not exist; {saved.directory / 'best'} "
                                "does (dist=ddp runs write .pt files, dist=fsdp runs folders without .pt)")


def test_resume_auto_takes_last_and_falls_back_past_an_incomplete_directory(saved: ShardedStore):
    assert layout.resume_path(saved.directory, "auto") == saved.directory / "last"
    with pytest.raises(UsageError, match="already holds a run"):
        layout.resume_path(saved.directory, None)
    assert layout.newest_first(saved.directory) == [saved.directory / "last", saved.directory / "step_000000005"]
    (saved.directory / "step_000000015" / ".metadata").unlink()  # as if killed before the index was renamed in
    with pytest.raises(UsageError, match=r"step_000000015 is incomplete \(no .metadata or state.pt"):
        checkpoint.read(saved.directory / "last")
    for folder in (saved.directory.parent, saved.directory):  # a run dir, or its checkpoints/, given as a checkpoint
        with pytest.raises(UsageError) as error:
            checkpoint.read(folder)
        assert str(error.value) == f"checkpoint {folder} is a folder of checkpoints: name one, e.g. " \
                                   f"{saved.directory / 'last'}"
    with pytest.raises(UsageError, match=r"step_000000015 is incomplete \(no .metadata or state.pt\): its save did "
                                         r"not finish, or it is no checkpoint$"):
        checkpoint.read(saved.directory / "step_000000015")
    assert checkpoint.read(saved.directory / "step_000000005").loop["step"] == 5


def test_restore_reads_the_model_and_optimizer_into_a_fresh_pair(saved: ShardedStore):
    model, optimizer = trained(0)
    fresh_model, fresh_optimizer = trained(1)
    checkpoint.read(saved.directory / "last").restore(parts(fresh_model, fresh_optimizer))
    for ours, theirs in zip(fresh_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(ours, theirs)
        assert torch.equal(fresh_optimizer.state[ours]["momentum_buffer"], optimizer.state[theirs]["momentum_buffer"])
    whole = checkpoint.read(saved.directory / "step_000000015").model_weights()
    assert all(torch.equal(whole[name], tensor) for name, tensor in model.state_dict().items())


def test_an_optimizer_state_is_keyed_by_parameter_name():
    model, optimizer = trained(0)
    by_name = OptimizerState(model, optimizer).state_dict()
    assert list(by_name["state"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert by_name["param_groups"][0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_init_from_gathers_a_sharded_checkpoint_into_whole_weights(saved: ShardedStore):
    from src.loop import init_from

    model, _ = trained(0)
    fresh, _ = trained(1)
    init_from.load_initial_weights({"model": fresh}, "model", saved.directory / "best", strict=True)
    assert all(torch.equal(tensor, model.state_dict()[name]) for name, tensor in fresh.state_dict().items())
