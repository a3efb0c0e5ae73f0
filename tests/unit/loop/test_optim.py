"""The optimizer: parameter groups, fused kernels on sharded parameters, LR schedules counted in optimizer steps."""

import math

import pytest
import torch

from src.common.errors import UsageError
from src.loop import optim


def lrs(factory, steps, **options):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = factory(opt, total_steps=steps, steps_per_epoch=10, **options)
    values = []
    for _ in range(steps):
        values.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return values


def test_cosine_warms_up_linearly_then_decays_to_the_floor():
    values = lrs(optim.cosine_with_warmup, 100, warmup_epochs=1, min_lr_ratio=0.1)
    assert values[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])
    assert values[10] == pytest.approx(1.0)
    midpoint = 10 + 45
    assert values[midpoint] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert values[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 89 / 90)))
    assert all(a >= b for a, b in zip(values[10:], values[11:]))


def test_step_decay_counts_epochs_in_steps():
    values = lrs(optim.step_decay, 50, step_epochs=2, gamma=0.5)
    assert values[0] == values[19] == 1.0
    assert values[20] == values[39] == 0.5
    assert values[40] == 0.25


def test_constant_with_warmup():
    values = lrs(optim.constant, 30, warmup_epochs=0.5)
    assert values[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert set(values[5:]) == {1.0}


@pytest.mark.parametrize("factory", [optim.constant, optim.cosine_with_warmup])
def test_a_warmup_longer_than_the_run_is_warned_of_once_and_spans_the_run(factory, caplog, monkeypatch):
    values = lrs(factory, 20, warmup_epochs=3)  # 30 warmup steps asked of a 20-step run
    assert values == pytest.approx([(i + 1) / 20 for i in range(20)])
    (record,) = [record for record in caplog.records if record.name == optim.__name__]
    assert record.levelname == "WARNING" and record.getMessage() == (
        "warmup_epochs=3 is 30 optimizer steps, more than the run's 20: the warmup spans the whole run")
    caplog.clear()
    assert lrs(factory, 20, warmup_epochs=2)[-1] == pytest.approx(1.0)  # a warmup as long as the run: no warning
    monkeypatch.setenv("RANK", "1")
    assert lrs(factory, 20, warmup_epochs=3) == values  # rank 1: the same schedule, the warning said by rank 0 only
    assert not caplog.records


def test_schedule_state_round_trips_through_a_checkpoint():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = optim.cosine_with_warmup(opt, total_steps=100, steps_per_epoch=10, warmup_epochs=1)
    for _ in range(37):
        opt.step()
        scheduler.step()
    fresh_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    fresh = optim.cosine_with_warmup(fresh_opt, total_steps=100, steps_per_epoch=10, warmup_epochs=1)
    fresh.load_state_dict(scheduler.state_dict())
    fresh_opt.load_state_dict(opt.state_dict())
    assert fresh.last_epoch == 37
    assert fresh.get_last_lr() == pytest.approx(scheduler.get_last_lr())


def test_build_optimizer_completes_the_partial_and_reports_torchs_refusals():
    from omegaconf import OmegaConf

    from src.common.errors import UsageError
    from src.loop.optim import build_optimizer

    params = [torch.nn.Parameter(torch.zeros(2))]
    cfg = OmegaConf.create({"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 0.01, "betas": [0.9, 0.99]})
    optimizer = build_optimizer(cfg, params)
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.param_groups[0]["betas"] == (0.9, 0.99)
    cfg.betas = [1.5, 0.99]
    with pytest.raises(UsageError, match=r"torch.optim.AdamW refused its settings \(Invalid beta parameter at index 0"):
        build_optimizer(cfg, params)
    cfg.betas = [0.9]  # one beta: torch indexes the second (a plain list, not OmegaConf's, whose error spans lines)
    with pytest.raises(UsageError, match=r"^torch.optim.AdamW refused its settings \(list index out of range\): "):
        build_optimizer(cfg, params)
    cfg.betas = [0.9, 0.99]
    cfg.weight_decay = "abc"  # judged by torch's annotation before torch compares it (a TypeError from deep inside)
    with pytest.raises(UsageError, match=r"^optimizer.weight_decay=abc: torch.optim.AdamW takes weight_decay: float$"):
        build_optimizer(cfg, params)
    cfg.pop("weight_decay")
    sgd = OmegaConf.create({"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1, "nesterov": "abc"})
    with pytest.raises(UsageError, match=r"^optimizer.nesterov=abc: torch.optim.SGD takes nesterov: bool$"):
        build_optimizer(sgd, params)  # SGD stores it and reads it at its first step: the build refuses it
    cfg._target_ = "torch.optim.RMSprop"  # a YAML copied from adamw.yaml keeps `fused`, which RMSprop lacks
    cfg.pop("betas")
    cfg.fused = True
    fused = r"^optimizer.fused is not an argument of optimizer: torch.optim.RMSprop takes params, lr, .*; remove it"
    with pytest.raises(UsageError, match=fused + r", or drop it for this run with ~optimizer.fused$"):
        build_optimizer(cfg, params)
    cfg.fused = None  # torch's default is accepted by every class that has the key
    cfg._target_ = "torch.optim.Adam"
    assert build_optimizer(cfg, params).param_groups[0]["fused"] is None


def test_sharded_parameters_keep_a_fused_kernel_that_takes_them_and_others_fall_back_to_foreach(tmp_path):
    """FSDP2's DTensor shards (a one-rank group): torch 2.14's fused AdamW takes them and steps them to the very
    values it gives plain tensors; its fused SGD does not (no DTensor sharding rule), so foreach instead."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from src.loop.optim import build_optimizer
    from src.parallel.fsdp import shard

    def trained(target: str, sharded: bool) -> tuple[torch.optim.Optimizer, torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Linear(5, 3)
        if sharded:
            shard(model, [], True, False, None)
        cfg = OmegaConf.create({"_target_": target, "_partial_": True, "lr": 0.1, "fused": True})
        optimizer = build_optimizer(cfg, model.parameters(), sharded=sharded)
        for step in range(3):
            model(torch.full((4, 5), step + 1.0)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        weight = model.weight.full_tensor() if sharded else model.weight
        return optimizer, weight.detach()

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        adamw, sharded_weight = trained("torch.optim.AdamW", sharded=True)
        sgd, _ = trained("torch.optim.SGD", sharded=True)
    finally:
        dist.destroy_process_group()
    assert adamw.defaults["fused"] is True and not adamw.defaults["foreach"]
    assert sgd.defaults["fused"] is None and sgd.defaults["foreach"] is True
    plain, plain_weight = trained("torch.optim.AdamW", sharded=False)
    assert plain.defaults["fused"] is True and torch.equal(sharded_weight, plain_weight)
    assert not torch.equal(plain_weight, trained("torch.optim.SGD", sharded=False)[1])


def test_settings_torch_refuses_are_one_line_on_sharded_parameters_too(tmp_path):
    """The fused-kernel probe builds the optimizer first: its refusals are the same UsageErrors."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from src.common.errors import UsageError
    from src.loop.optim import build_optimizer
    from src.parallel.fsdp import shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = shard(torch.nn.Linear(5, 3), [], True, False, None)
        cfg = OmegaConf.create({"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 0.1, "fused": True,
                                "betas": [1.5, 0.99]})
        with pytest.raises(UsageError, match=r"torch.optim.AdamW refused its settings \(Invalid beta parameter"):
            build_optimizer(cfg, model.parameters(), sharded=True)
        cfg.pop("betas")
        cfg.momentum_decay = 0.1
        with pytest.raises(UsageError, match=r"^optimizer.momentum_decay is not an argument of optimizer: "
                                             r"torch.optim.AdamW takes params, .*; remove it, or drop it"):
            build_optimizer(cfg, model.parameters(), sharded=True)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="measured on x86 SIMD")
def test_torchs_fused_cpu_adamw_rounds_a_tensors_tail_apart_from_its_body():
    """Why dist=fsdp's AdamW updates can differ from dist=ddp's in the last bits (test_fsdp_cli.py ADAMW): torch's
    fused CPU kernel rounds a tensor's last (length mod 8) elements, its scalar tail, differently from its 8-wide
    body. A tensor stepped whole and as two halves: equal when the first half holds 8 elements, not when it holds 5
    (a 10-class head's bias sharded over 2 ranks)."""

    def gap(length: int, cut: int) -> float:
        generator = torch.Generator().manual_seed(0)
        whole = torch.nn.Parameter(torch.randn(length, generator=generator) * 0.1)
        halves = [torch.nn.Parameter(half.clone()) for half in whole.detach().split([cut, length - cut])]
        optimizers = [torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0, fused=True) for params in ([whole], halves)]
        for _ in range(200):
            grad = torch.randn(length, generator=generator) * 10 ** (-6 * torch.rand(1, generator=generator).item())
            whole.grad = grad.clone()
            for half, part in zip(halves, grad.split([cut, length - cut])):
                half.grad = part.clone()
            for optimizer in optimizers:
                optimizer.step()
        return (whole.detach() - torch.cat([half.detach() for half in halves])).abs().max().item()

    assert gap(16, 8) == 0 and gap(40, 24) == 0
    assert 0 < gap(10, 5) < 1e-6


def test_parameter_groups_decay_no_bias_or_norm_weight_by_default_and_multiply_learning_rates_by_prefix():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    named = list(model.named_parameters())

    def groups(**options) -> list[tuple[list[str], float, float | None]]:
        names = {id(parameter): name for name, parameter in named}
        built = optim.parameter_groups(named, **{"lr": 0.1, "weight_decay": 0.05, "lr_multipliers": {},
                                                 "decay_norm_and_bias": False, **options})
        return [([names[id(p)] for p in group["params"]], group.get("weight_decay"), group.get("lr"))
                for group in built]

    assert groups() == [(["0.weight", "2.weight"], None, None), (["0.bias", "1.weight", "1.bias", "2.bias"], 0.0, None)]
    assert groups(decay_norm_and_bias=True) == [([name for name, _ in named], None, None)]
    assert groups(weight_decay=0.0) == [([name for name, _ in named], None, None)]
    assert groups(lr_multipliers={"*": 0.1, "2": 1.0}, decay_norm_and_bias=True) == [
        (["0.weight", "0.bias", "1.weight", "1.bias"], None, pytest.approx(0.01)), (["2.weight", "2.bias"], None, 0.1)]
    with pytest.raises(UsageError, match=r"^optimizer.lr_multipliers: head is the prefix of no trained parameter's "
                                         r"name \(they begin with 0, 1, 2\)$"):
        groups(lr_multipliers={"head": 1.0})
    with pytest.raises(UsageError, match="needs optimizer.lr"):
        groups(lr=None, lr_multipliers={"2": 1.0})
