"""Tests for src/parallel/sync_batchnorm.py.

The distributed cases all run in one spawn of three gloo processes, because starting a
process that imports torch costs seconds. Each case says which ranks take part: all
three (the default group), a two-rank subgroup or a one-rank subgroup (both passed as
`process_group`). Each rank trains on its slice of the case's global batch and saves what
it saw; the test process compares that with one plain BatchNorm on the whole batch.
"""

from __future__ import annotations

import copy
import datetime
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from src.parallel.sync_batchnorm import CPUSyncBatchNorm, convert_sync_batchnorm

WORLD_SIZE = 3
ALL_RANKS = (0, 1, 2)
PAIR = (0, 1)
SOLO = (2,)
# Float32 sums of squares differ from BatchNorm's own reduction by rounding only.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


@dataclass
class Case:
    """A BatchNorm trained for a few steps on global batches split across `ranks`."""

    module: _BatchNorm  # the single-process reference; the sync-BN loads its state_dict
    ranks: tuple[int, ...]
    per_rank_batch_sizes: tuple[int, ...]  # in the order of `ranks`
    inputs: list[torch.Tensor]  # one global batch per step
    loss_weights: list[torch.Tensor]  # loss = sum(output * loss_weight) over the global batch
    synced: bool = True  # False: each rank runs a copy of the plain BatchNorm
    autocast: bool = False  # bfloat16 inputs under torch.autocast

    def rank_slice(self, rank: int) -> slice:
        """The samples of the global batch that `rank` holds."""
        index = self.ranks.index(rank)
        start = sum(self.per_rank_batch_sizes[:index])
        return slice(start, start + self.per_rank_batch_sizes[index])


def _make_case(
    module: _BatchNorm,
    ranks: tuple[int, ...],
    per_rank_batch_sizes: tuple[int, ...],
    sample_shape: tuple[int, ...],
    steps: int = 2,
    **options: bool,
) -> Case:
    """Random affine parameters and inputs with a non-zero mean, reproducible from a fixed seed."""
    generator = torch.Generator().manual_seed(0)
    if module.affine:
        with torch.no_grad():
            module.weight.uniform_(0.5, 1.5, generator=generator)
            module.bias.uniform_(-0.5, 0.5, generator=generator)
    shape = (sum(per_rank_batch_sizes), module.num_features, *sample_shape)
    inputs = [torch.randn(shape, generator=generator) * 2 + 1 for _ in range(steps)]
    if options.get("autocast"):
        inputs = [x.bfloat16() for x in inputs]
    loss_weights = [torch.randn(shape, generator=generator) for _ in range(steps)]
    return Case(module, ranks, per_rank_batch_sizes, inputs, loss_weights, **options)


SYNCED_CASES = {
    "bn2d_uneven_pair": _make_case(nn.BatchNorm2d(3), PAIR, (5, 11), (4, 4)),
    "bn2d_cumulative_average": _make_case(nn.BatchNorm2d(3, momentum=None), PAIR, (8, 8), (4, 4), steps=3),
    "bn1d_nc_input": _make_case(nn.BatchNorm1d(5), PAIR, (3, 7), ()),
    "bn1d_ncl_three_ranks": _make_case(nn.BatchNorm1d(4), ALL_RANKS, (2, 7, 3), (6,)),
    "bn3d_no_affine_three_ranks": _make_case(
        nn.BatchNorm3d(2, affine=False), ALL_RANKS, (4, 1, 5), (3, 3, 3)
    ),
    "bn2d_no_running_stats": _make_case(nn.BatchNorm2d(3, track_running_stats=False), PAIR, (6, 10), (4, 4)),
}
CASES = {
    **SYNCED_CASES,
    "per_rank_plain_batchnorm": _make_case(nn.BatchNorm2d(3), PAIR, (5, 11), (4, 4), synced=False),
    "group_of_one": _make_case(nn.BatchNorm2d(3), SOLO, (12,), (4, 4)),
    "bfloat16_autocast": _make_case(nn.BatchNorm2d(3), PAIR, (5, 11), (4, 4), autocast=True),
}


def _train_then_eval(bn: nn.Module, inputs: list[torch.Tensor], loss_weights: list[torch.Tensor]) -> dict:
    """One forward and backward per batch in train mode, then one eval forward on the last batch."""
    bn.train()
    outputs, input_grads = [], []
    for x, loss_weight in zip(inputs, loss_weights):
        x = x.clone().requires_grad_()
        output = bn(x)
        (output.float() * loss_weight).sum().backward()
        outputs.append(output.detach())
        input_grads.append(x.grad)
    result = {
        "output": torch.stack(outputs),
        "input_grad": torch.stack(input_grads),
        "param_grads": {name: p.grad for name, p in bn.named_parameters()},
        "buffers": {name: b.clone() for name, b in bn.named_buffers()},
    }
    with torch.no_grad():
        result["eval_output"] = bn.eval()(inputs[-1])
    return result


def _run_case(case: Case, rank: int, group: dist.ProcessGroup | None) -> dict:
    """Train this rank's copy of the case's module on this rank's slice of each global batch."""
    reference = case.module
    if case.synced:
        bn = CPUSyncBatchNorm(
            reference.num_features, reference.eps, reference.momentum, reference.affine,
            reference.track_running_stats, process_group=group,
        )
        bn.load_state_dict(reference.state_dict())
    else:
        bn = copy.deepcopy(reference)
    local = case.rank_slice(rank)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.autocast):
        return _train_then_eval(bn, [x[local] for x in case.inputs], [w[local] for w in case.loss_weights])


def _worker(rank: int, init_file: str, out_dir: str, cases: dict[str, Case]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=60),
    )
    # Every rank must create every group, in the same order.
    groups = {ALL_RANKS: None, PAIR: dist.new_group(list(PAIR)), SOLO: dist.new_group(list(SOLO))}
    results = {
        name: _run_case(case, rank, groups[case.ranks]) for name, case in cases.items() if rank in case.ranks
    }
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """What each rank saw, per case name; the file:// rendezvous avoids port races between runs."""
    out_dir = tmp_path_factory.mktemp("sync_batchnorm")
    mp.spawn(_worker, args=(str(out_dir / "rendezvous"), str(out_dir), CASES), nprocs=WORLD_SIZE)
    return {rank: torch.load(out_dir / f"rank{rank}.pt") for rank in range(WORLD_SIZE)}


def _single_process_reference(case: Case) -> dict:
    """The same steps with the plain BatchNorm on whole global batches, in float32."""
    return _train_then_eval(copy.deepcopy(case.module), [x.float() for x in case.inputs], case.loss_weights)


@pytest.mark.parametrize("name", SYNCED_CASES)
def test_forward_and_running_stats_match_one_batchnorm_on_global_batch(name: str, rank_results: dict) -> None:
    case = CASES[name]
    reference = _single_process_reference(case)
    for rank in case.ranks:
        seen = rank_results[rank][name]
        local = case.rank_slice(rank)
        torch.testing.assert_close(seen["output"], reference["output"][:, local], **TOLERANCE)
        torch.testing.assert_close(seen["buffers"], reference["buffers"], **TOLERANCE)
        if case.module.track_running_stats:
            torch.testing.assert_close(seen["eval_output"], reference["eval_output"][local], **TOLERANCE)


@pytest.mark.parametrize("name", SYNCED_CASES)
def test_gradients_match_one_batchnorm_on_global_batch(name: str, rank_results: dict) -> None:
    case = CASES[name]
    reference = _single_process_reference(case)
    for rank in case.ranks:
        expected_input_grad = reference["input_grad"][:, case.rank_slice(rank)]
        torch.testing.assert_close(rank_results[rank][name]["input_grad"], expected_input_grad, **TOLERANCE)
    # Each rank's loss covers its slice only, so the global loss's parameter gradients are the
    # sum over ranks (DDP would average them; the test loss is a sum to keep that out of the way).
    for param_name, grad in reference["param_grads"].items():
        summed = sum(rank_results[rank][name]["param_grads"][param_name] for rank in case.ranks)
        torch.testing.assert_close(summed, grad, **TOLERANCE)


def test_per_rank_plain_batchnorm_differs_from_global_batch(rank_results: dict) -> None:
    """Without synchronisation the comparison above fails, so it does test the synchronisation."""
    case = CASES["per_rank_plain_batchnorm"]
    reference = _single_process_reference(case)
    for rank in case.ranks:
        seen = rank_results[rank]["per_rank_plain_batchnorm"]
        for buffer in ("running_mean", "running_var"):
            assert not torch.allclose(seen["buffers"][buffer], reference["buffers"][buffer], **TOLERANCE)
        assert not torch.allclose(seen["output"], reference["output"][:, case.rank_slice(rank)], **TOLERANCE)


def test_group_of_one_is_exactly_plain_batchnorm(rank_results: dict) -> None:
    reference = _single_process_reference(CASES["group_of_one"])
    torch.testing.assert_close(rank_results[2]["group_of_one"], reference, rtol=0, atol=0)


def test_bfloat16_under_autocast_keeps_dtype_and_float32_statistics(rank_results: dict) -> None:
    case = CASES["bfloat16_autocast"]
    reference = _single_process_reference(case)
    for rank in case.ranks:
        seen = rank_results[rank]["bfloat16_autocast"]
        assert seen["output"].dtype == torch.bfloat16
        expected_output = reference["output"][:, case.rank_slice(rank)]
        torch.testing.assert_close(seen["output"].float(), expected_output, rtol=1e-2, atol=2e-2)
        # bfloat16 sums of 256 values per channel would be off by about 1e-2; float32 ones match.
        torch.testing.assert_close(seen["buffers"], reference["buffers"], **TOLERANCE)


def _small_model() -> nn.Sequential:
    """A nested model with BatchNorm2d and BatchNorm1d holding non-default state."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 6), nn.BatchNorm1d(6, momentum=None, eps=1e-3)),
    )
    for bn in (model[1], model[3][2]):
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            bn.num_batches_tracked.fill_(7)
    model[1].bias.requires_grad_(False)
    return model


def _batchnorm_settings(model: nn.Module) -> list[tuple]:
    return [
        (m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats)
        for m in model.modules()
        if isinstance(m, _BatchNorm)
    ]


def test_convert_replaces_batchnorm_and_keeps_state() -> None:
    original = _small_model()
    converted = convert_sync_batchnorm(copy.deepcopy(original), torch.device("cpu"))

    expected_types = [
        CPUSyncBatchNorm if isinstance(m, _BatchNorm) else type(m) for m in original.modules()
    ]
    assert [type(m) for m in converted.modules()] == expected_types
    assert _batchnorm_settings(converted) == _batchnorm_settings(original)
    assert list(converted.state_dict()) == list(original.state_dict())
    torch.testing.assert_close(converted.state_dict(), original.state_dict(), rtol=0, atol=0)
    frozen = [name for name, p in original.named_parameters() if not p.requires_grad]
    assert frozen == [name for name, p in converted.named_parameters() if not p.requires_grad] == ["1.bias"]
    # Checkpoints move between models with and without sync-BN.
    copy.deepcopy(original).load_state_dict(converted.state_dict())
    copy.deepcopy(converted).load_state_dict(original.state_dict())


def test_convert_leaves_sync_batchnorm_alone_and_converts_a_bare_batchnorm() -> None:
    converted = convert_sync_batchnorm(_small_model(), torch.device("cpu"))
    sync_layers = [m for m in converted.modules() if isinstance(m, CPUSyncBatchNorm)]
    again = convert_sync_batchnorm(converted, torch.device("cpu"))
    assert [m for m in again.modules() if isinstance(m, CPUSyncBatchNorm)] == sync_layers
    assert type(convert_sync_batchnorm(nn.BatchNorm1d(3), torch.device("cpu"))) is CPUSyncBatchNorm


def test_convert_for_cuda_uses_torch_sync_batchnorm() -> None:
    # nn.SyncBatchNorm only refuses the CPU once wrapped in DDP, so converting needs no GPU.
    converted = convert_sync_batchnorm(_small_model(), torch.device("cuda"))
    assert sum(isinstance(m, nn.SyncBatchNorm) for m in converted.modules()) == 2


def test_converted_model_without_process_group_equals_original() -> None:
    original = _small_model()
    converted = convert_sync_batchnorm(copy.deepcopy(original), torch.device("cpu"))
    x = torch.randn(8, 2, 6, 6)
    torch.testing.assert_close(converted.train()(x), original.train()(x), rtol=0, atol=0)
    torch.testing.assert_close(converted.state_dict(), original.state_dict(), rtol=0, atol=0)
    torch.testing.assert_close(converted.eval()(x), original.eval()(x), rtol=0, atol=0)



# ---- a bias feeding a BatchNorm directly: warned once, on the first forward --------------------------------------


class BiasIntoBatchNorm(nn.Module):
    """Each way a layer's output may reach a BatchNorm: straight (warned), through a ReLU, without a bias, with a
    frozen bias (not warned); the forward is code, not a Sequential."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, padding=1)  # biased, straight into stem_bn: warned
        self.stem_bn = nn.BatchNorm2d(4)
        self.mid = nn.Conv2d(4, 4, 3, padding=1)  # biased, but a ReLU between
        self.mid_bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(16, 8, bias=False)
        self.head_bn = nn.BatchNorm1d(8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.bias.requires_grad_(False)
        self.frozen_bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)  # biased, into a BatchNorm1d: warned
        self.out_bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem_bn(self.stem(x))
        x = self.mid_bn(torch.relu(self.mid(x)))
        x = nn.functional.adaptive_avg_pool2d(x, 2).flatten(1)
        x = self.frozen_bn(self.frozen(self.head_bn(self.head(x))))
        return self.out_bn(self.out(x))


def test_a_bias_feeding_a_batchnorm_directly_is_warned_once_per_layer_on_the_first_forward(caplog):
    from src.parallel.sync_batchnorm import warn_of_bias_before_batchnorm

    model = BiasIntoBatchNorm()
    warn_of_bias_before_batchnorm(model)
    with caplog.at_level("WARNING"):
        model(torch.randn(4, 1, 6, 6))
        model(torch.randn(4, 1, 6, 6))  # the hooks are gone: no second warning
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2 and all("\n" not in line for line in lines)
    assert lines[0].startswith("stem has a bias feeding the BatchNorm stem_bn directly") and \
        lines[0].endswith("give stem bias=False")
    assert lines[1].startswith("out has a bias feeding the BatchNorm out_bn directly")
    assert not any(layer._forward_hooks or layer._forward_pre_hooks for layer in model.modules())


@pytest.mark.parametrize("device, kind", [("cpu", "CPUSyncBatchNormThen"), ("cuda", "SyncBatchNormThen")])
def test_a_batchnorm_with_its_own_activation_keeps_it_when_synchronised(device: str, kind: str):
    """timm's BatchNormAct2d runs a dropout and an activation after normalising; torch's converter drops them."""
    from timm.layers import BatchNormAct2d

    torch.manual_seed(0)
    original = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), BatchNormAct2d(4, act_layer=nn.ReLU))
    converted = convert_sync_batchnorm(copy.deepcopy(original), torch.device(device))
    assert type(converted[1]).__name__ == kind and isinstance(converted[1].act, nn.ReLU)
    assert converted.state_dict().keys() == original.state_dict().keys()
    if device == "cpu":  # one process: the sync-BN is BatchNorm itself
        x = torch.randn(5, 3, 6, 6)
        for mode in (True, False):
            original.train(mode), converted.train(mode)
            output = converted(x)
            assert torch.equal(output, original(x)) and output.min() >= 0
