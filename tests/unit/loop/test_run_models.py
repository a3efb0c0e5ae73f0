"""The run's models from the config (src/loop/task_and_model.py; src/config/building.py `named`, `per_model`): one
model or several by name, each with an optimizer and schedule of its own; frozen auxiliary models; and what each
refuses in one line. In one process; the CLI runs of several models: tests/integration/test_recipes_cli.py."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from src.common.errors import UsageError
from src.config.building import named, per_model
from src.config.schema import TrainerConfig
from src.loop import task_and_model as models
from src.loop.task import Task
from src.parallel.distributed import DistEnv, Runtime
from src.recipes.gan import GAN

MLP = {"_target_": "src.components.models.MLP", "in_features": 4, "num_outputs": 2, "hidden_sizes": [3]}
SGD = {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1}
CONSTANT = {"_target_": "src.loop.optim.constant", "_partial_": True}
CONF = Path(__file__).resolve().parents[3] / "conf"
RUNTIME = Runtime(DistEnv(), torch.device("cpu"), backend=None)


def config(model, optimizer=SGD, scheduler=CONSTANT, **extra):  # noqa: ANN001, ANN201
    return OmegaConf.create({"model": model, "optimizer": optimizer, "scheduler": scheduler, "seed": 0,
                             "dist": {"strategy": "ddp", "sync_bn": True, "find_unused_parameters": False,
                                      "fsdp": {}}, **extra})


def test_one_model_config_is_the_model_named_model_and_several_keep_their_names():
    assert list(named(OmegaConf.create(MLP), "model")) == ["model"]
    assert list(named(OmegaConf.create({"generator": MLP, "discriminator": MLP}), "model")) == ["generator",
                                                                                               "discriminator"]
    with pytest.raises(UsageError, match="model names no _target_: give it one"):
        named(OmegaConf.create({"generator": {"lr": 1}}), "model")
    with pytest.raises(UsageError, match=r"^optimizer names no _target_: .*, or one per name, each with its _target_ "
                                         r"\(docs/forking.md\); optimizer.lr is neither$"):  # a key left beside them
        named(OmegaConf.create({"lr": 0.1, "generator": SGD}), "optimizer")


def test_each_model_gets_an_optimizer_and_schedule_of_its_own():
    cfg = config({"generator": MLP, "discriminator": {**MLP, "num_outputs": 1}})
    modules, train_models = models.build_trained(cfg, TrainerConfig(), GAN(), RUNTIME)
    assert list(modules) == ["generator", "discriminator"] and train_models["generator"] is modules["generator"]
    optimizers, schedulers = models.build_optimizers(cfg, modules, steps_per_epoch=5, epochs=2)
    assert optimizers["generator"] is not optimizers["discriminator"]
    for name, optimizer in optimizers.items():
        assert [p for group in optimizer.param_groups for p in group["params"]] == list(modules[name].parameters())
        assert schedulers[name].optimizer is optimizer


def test_optimizers_by_model_name_take_each_its_own_settings_and_must_name_every_model():
    cfg = config({"generator": MLP, "discriminator": MLP},
                 optimizer={"generator": {**SGD, "lr": 0.5}, "discriminator": {**SGD, "lr": 0.01}})
    modules, _ = models.build_trained(cfg, TrainerConfig(), GAN(), RUNTIME)
    optimizers, _ = models.build_optimizers(cfg, modules, steps_per_epoch=5, epochs=2)
    assert optimizers["generator"].param_groups[0]["lr"] == 0.5 and optimizers["discriminator"].defaults["lr"] == 0.01
    with pytest.raises(UsageError, match="optimizer names generator, but the run's models are generator, "
                                         "discriminator: give one optimizer for each model"):
        per_model(OmegaConf.create({"generator": SGD}), "optimizer", ["generator", "discriminator"])


def test_one_optimizer_for_all_that_also_names_a_model_is_one_line_showing_the_per_model_form():
    node = OmegaConf.create({**SGD, "generator": {"_target_": "torch.optim.Adam", "_partial_": True}})
    with pytest.raises(UsageError) as error:
        per_model(node, "optimizer", ["generator", "discriminator"])
    assert str(error.value) == (
        "optimizer is one config for all models (torch.optim.SGD), and names model generator too: give one optimizer "
        "for each model by its name (+optimizer@optimizer.generator=OPTION +optimizer@optimizer.discriminator=OPTION "
        "after ~optimizer: docs/forking.md), or set optimizer.KEY for all")


def test_the_per_model_form_the_errors_show_composes_each_model_s_own_optimizer_and_schedule():
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", ["task=gan", "model=gan_mlp", "~optimizer", "+optimizer@optimizer.generator=adam",
                                 "+optimizer@optimizer.discriminator=sgd", "optimizer.discriminator.lr=0.02",
                                 "~scheduler", "+scheduler@scheduler.generator=cosine",
                                 "+scheduler@scheduler.discriminator=constant"])
    cfg = config({"generator": MLP, "discriminator": MLP}, optimizer=cfg.optimizer, scheduler=cfg.scheduler)
    modules, _ = models.build_trained(cfg, TrainerConfig(), GAN(), RUNTIME)
    optimizers, schedulers = models.build_optimizers(cfg, modules, steps_per_epoch=5, epochs=2)
    assert type(optimizers["generator"]) is torch.optim.Adam and type(optimizers["discriminator"]) is torch.optim.SGD
    assert optimizers["discriminator"].defaults["lr"] == 0.02
    for _, name in itertools.product(range(10), optimizers):
        optimizers[name].step()  # no gradients: no update
        schedulers[name].step()
    assert optimizers["discriminator"].param_groups[0]["lr"] == 0.02  # constant; the cosine one has decayed
    assert optimizers["generator"].param_groups[0]["lr"] < optimizers["generator"].defaults["lr"] / 10


def test_a_task_refuses_models_it_does_not_train():
    with pytest.raises(UsageError, match="task=GAN trains the models generator, discriminator, but the model config "
                                         "names model"):
        models.build_trained(config(MLP), TrainerConfig(), GAN(), RUNTIME)
    with pytest.raises(UsageError, match="task=Task trains the models model, but the model config names a, b"):
        models.build_trained(config({"a": MLP, "b": MLP}), TrainerConfig(), Task(), RUNTIME)


def test_freeze_names_a_model_s_parameters_by_its_name_in_a_run_of_several():
    cfg = config({"generator": MLP, "discriminator": MLP})
    modules, _ = models.build_trained(cfg, TrainerConfig(freeze=["discriminator.net.1."]), GAN(), RUNTIME)
    frozen = [f"{model}.{name}" for model, module in modules.items()
              for name, p in module.named_parameters() if not p.requires_grad]
    assert frozen == ["discriminator.net.1.weight", "discriminator.net.1.bias"]
    with pytest.raises(UsageError, match="no parameter name starts with net.1.; the model's parameter names start "
                                         "with discriminator.net, generator.net"):
        models.build_trained(cfg, TrainerConfig(freeze=["net.1."]), GAN(), RUNTIME)
    with pytest.raises(UsageError, match=r"^trainer.freeze=\['discriminator.'\] freezes every parameter of model "
                                         r"'discriminator', which would not train: a model used frozen is an aux model "
                                         r"\(aux.discriminator.path\)$"):
        models.build_trained(cfg, TrainerConfig(freeze=["discriminator."]), GAN(), RUNTIME)


class Student(Task):
    aux_models = ("teacher",)


def test_an_auxiliary_model_is_frozen_in_eval_mode_from_a_checkpoint_s_own_config(tmp_path: Path):
    from src.checkpoint.file_store import FileStore
    from src.checkpoint.states import ModelState, Named
    from src.components.models import MLP as MLPModel

    torch.manual_seed(0)
    teacher = MLPModel(in_features=4, num_outputs=2, hidden_sizes=[3])
    FileStore(tmp_path, is_main_process=True).save(
        {"models": Named({"model": ModelState(teacher)}, "model"), "config": {"model": MLP, "task": {}},
         "output_model": "model"}, step=1, is_best=False)
    aux = models.build_aux(OmegaConf.create({"teacher": {"path": str(tmp_path / "last.pt")}, "unset": {"path": None}}),
                           Student(), torch.device("cpu"), trusted={MLP["_target_"]})
    assert list(aux) == ["teacher"]  # a path of null: no model
    loaded = aux["teacher"]
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), teacher.state_dict().values()))
    FileStore(tmp_path / "untrusted", is_main_process=True).save(
        {"models": Named({"model": ModelState(torch.nn.Identity())}, "model"),
         "config": {"model": {"_target_": "torch.nn.Identity"}}}, step=1, is_best=False)
    untrusted = (r"names model._target_=torch.nn.Identity, which no option of conf/ .*pass the config folder of its "
                 r"run \(hydra.searchpath=\[file://DIR\]\)")
    with pytest.raises(UsageError, match=untrusted):
        models.build_aux(OmegaConf.create({"teacher": {"path": str(tmp_path / "untrusted" / "last.pt")}}), Student(),
                         torch.device("cpu"), trusted=set())
    with pytest.raises(UsageError, match="^task=Student needs the auxiliary model teacher: set aux.teacher.path="):
        models.build_aux(OmegaConf.create({}), Student(), torch.device("cpu"), trusted=set())
