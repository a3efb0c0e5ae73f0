"""src/config/schema.py: each setting declared once, its default what the config composes to, its value
checked once when the run starts (the command-line rows are in tests/integration/test_bad_input.py)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from src.common.errors import UsageError
from src.config import schema
from src.parallel import job  # noqa: F401 - registers ${data:} ... as train.py does

CONF = Path(__file__).resolve().parents[3] / "conf"


def composed(config_name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name, overrides=overrides)
    return cfg


def test_the_composed_trainer_and_dist_keys_are_the_dataclasses_defaults():
    cfg = composed("config", ["task=classification"])  # the monitor is the task's (a fork's default task may differ)
    trainer = OmegaConf.to_object(cfg.trainer)
    assert isinstance(trainer, schema.TrainerConfig)
    defaults = schema.TrainerConfig()
    for f in dataclasses.fields(schema.TrainerConfig):
        if f.name not in ("monitor", "monitor_mode"):  # interpolations of the task's: resolved here
            assert getattr(trainer, f.name) == getattr(defaults, f.name), f.name
    assert (trainer.epochs, trainer.precision, trainer.monitor, trainer.monitor_mode) == (20, 32, "val/acc", "max")
    assert OmegaConf.to_object(cfg.dist) == schema.DistConfig()


def test_presets_and_overrides_still_set_the_keys(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a preset's hydra.run.dir makes composing resolve the default one: fresh_dir makes it
    cfg = composed("config", ["debug=fast", "trainer.epochs=3", "dist.sync_bn=false", "task=regression"])
    assert (cfg.trainer.epochs, cfg.trainer.limit_train_batches, cfg.trainer.save_checkpoints) == (3, 2, False)
    assert cfg.dist.sync_bn is False and cfg.trainer.monitor_mode == "min"


def test_eval_shares_the_declarations():
    cfg = composed("eval", ["checkpoint=x.pt", "dataset=digits"])
    assert OmegaConf.to_object(cfg.trainer) == schema.EvalTrainerConfig(precision=None, device="auto")
    assert OmegaConf.to_object(cfg.dist) == schema.EvalDistConfig(backend="auto", timeout_s=1800.0)
    for train_settings, eval_settings in ((schema.TrainerConfig, schema.EvalTrainerConfig),
                                          (schema.DistConfig, schema.EvalDistConfig)):
        train_fields = {f.name: f for f in dataclasses.fields(train_settings)}
        for f in dataclasses.fields(eval_settings):
            assert f.type == train_fields[f.name].type, f.name


@pytest.mark.parametrize("override, message", [
    ("trainer.device=tpu", "trainer.device=tpu is not one of auto, cpu, cuda"),  # was select_device's check
    ("dist.backend=mpi", "dist.backend=mpi is not one of auto, nccl, gloo"),  # was select_backend's check
    ("trainer.precision=8", "trainer.precision=8 is not one of 32, bf16, 16"),  # was autocast_dtype's check
])
def test_device_backend_and_precision_are_checked_once_at_run_start(override, message):
    with pytest.raises(UsageError, match=message):
        schema.check_train_config(composed("config", [override]))


@pytest.mark.parametrize("override, message", [
    ("trainer.device=tpu", "not one of auto, cpu, cuda"),
    ("dist.backend=mpi", "not one of auto, nccl, gloo"),
    ("trainer.precision=8", "trainer.precision=8 is not one of 32, bf16, 16"),
    ("dataset.num_workers=-2", "dataset.num_workers=-2 must be a whole number >= 0"),
    ("dataset.batch_size=abc", "dataset.batch_size=abc must be a positive whole number"),
    ("+trainer.devic=cpu", "trainer.devic is not a setting (did you mean trainer.device?): nothing reads it; "
                           "remove it"),
])
def test_eval_checks_the_same_values(override, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        schema.check_eval_config(composed("eval", ["checkpoint=x.pt", "dataset=digits", override]))
    schema.check_eval_config(composed("eval", ["checkpoint=x.pt", "dataset=digits", "trainer.precision=null"]))


@pytest.mark.parametrize("overrides, message", [
    (["+trainer.epoch=3"], "trainer.epoch is not a setting (did you mean trainer.epochs?): nothing reads it; "
                           "remove it"),
    (["+dist.fsdp.wrapp=[Block]"], "dist.fsdp.wrapp is not a setting (did you mean dist.fsdp.wrap?): nothing reads it; "
                                   "remove it"),
    (["+my_flag=1", "+trainer.zzz.x=1"], "trainer.zzz is not a setting: nothing reads it; remove it; my_flag is not a "
                                         "setting: nothing reads it; remove it"),
])
def test_a_key_added_to_a_block_the_schema_declares_is_refused(overrides, message):
    """Hydra's `+` adds it, where the block's own keys are closed; nothing would read it: a typo trained silently."""
    with pytest.raises(UsageError) as error:
        schema.check_train_config(composed("config", overrides))
    assert str(error.value) == message
    schema.check_train_config(composed("config", ["+model.extra=1", "+logger.anything=2"]))  # open blocks: theirs


def test_every_problem_is_named_at_once_in_declaration_order():
    with pytest.raises(UsageError) as error:
        schema.check_train_config(composed("config", ["trainer.keep_last=0", "trainer.epochs=0"]))
    assert str(error.value) == "trainer.epochs=0 must be at least 1; trainer.keep_last=0 must be at least 1"


@pytest.mark.parametrize("overrides, message", [  # moved from tests/integration/test_bad_input.py's rows
    (["optimizer.lr=-0.1"], "optimizer.lr=-0.1 must be a number >= 0"),
    (["optimizer=sgd", "optimizer.lr=abc"], "optimizer.lr=abc must be a number >= 0"),
    (["scheduler.warmup_epochs=-1"], "scheduler.warmup_epochs=-1 must be a number >= 0"),
    (["scheduler=step", "scheduler.step_epochs=0"], "scheduler.step_epochs=0 must be a positive number"),
    (["scheduler=step", "scheduler.gamma=0"], "scheduler.gamma=0 must be a positive number"),
    (["dataset.num_workers=-1"], "dataset.num_workers=-1 must be a whole number >= 0"),
    (["dataset.num_workers=1.5"], "dataset.num_workers=1.5 must be a whole number >= 0"),
    (["dataset.val_batch_size=0"], "dataset.val_batch_size=0 must be a positive whole number"),
    (["dataset.val_batch_size=true"], "dataset.val_batch_size=True must be a positive whole number"),
    (["dataset.batch_size=0"], "dataset.batch_size=0 must be a positive whole number"),
    (["dataset.batch_size=2.5"], "dataset.batch_size=2.5 must be a positive whole number"),
    (["trainer.log_every_steps=0"], "trainer.log_every_steps=0 must be at least 1"),
    (["trainer.monitor_mode=maximum"], "trainer.monitor_mode=maximum is not one of max, min"),
    (["trainer.limit_train_batches=-1"], "trainer.limit_train_batches=-1 must be at least 1 (or null)"),
    (["trainer.overfit_batches=-2"], "trainer.overfit_batches=-2 must be at least 0"),
    (["dist.master_port=70000"], "dist.master_port=70000 is not a port (1-65535); leave it null for a free one"),
    (["dist.strategy=zero"], "dist.strategy=zero is not one of ddp, fsdp"),
    (["dataset=image_folder"], "dataset.root is required: add dataset.root=VALUE"),
    (["init_from=w.pt", "resume=last.pt"], "init_from=w.pt starts a fresh run from weights, resume=last.pt continues a "
                                           "run: pass only one (with resume=auto, init_from applies only when the run "
                                           "dir holds no checkpoint yet)"),
])
def test_each_value_the_types_let_through_is_refused_with_its_key_and_what_it_takes(overrides, message):
    """The command line's exit code 2 and single `error:` line for these: test_bad_input.py's schema rows."""
    with pytest.raises(UsageError) as error:
        schema.check_train_config(composed("config", overrides))
    assert str(error.value) == message
