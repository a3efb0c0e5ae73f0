"""src/config/hydra_errors.py: Hydra's compose errors as one line, checked against the config itself.

Each test composes conf/ with Hydra's public `compose` and describes the error it raises, as
train.py and eval.py do, in this process (no subprocess): the messages are checked exactly.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import hydra
import pytest
from conftest import REPO
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

import src.config.schema  # noqa: F401 - registers train_schema and eval_schema
from src.common.errors import USAGE_ERROR_EXIT_CODE
from src.config import hydra_errors


@pytest.fixture
def eval_dataset_option():
    """eval.py's default dataset option (a stored config, not a file of conf/), for this test only."""
    store = ConfigStore.instance()
    stored_before = "checkpoint.yaml" in store.repo.get("dataset", {})
    store.store(group="dataset", name="checkpoint", node=OmegaConf.create({}, flags={"struct": False}))
    yield
    if not stored_before:
        del store.repo["dataset"]["checkpoint.yaml"]


def error_of(overrides: list[str], config_name: str = "config", conf: Path = REPO / "conf") -> Exception:
    """The error Hydra raises composing `config_name` with these command-line overrides."""
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        with pytest.raises(Exception) as caught:
            compose(config_name, overrides)
    return caught.value


def described(overrides: list[str], config_name: str = "config", script: str = "train.py",
              conf: Path = REPO / "conf") -> str:
    """The line for the error of composing `config_name` with these overrides, as `script`'s command line."""
    error = error_of(overrides, config_name, conf)
    return hydra_errors.describe_config_error(error, script, overrides, config_name, conf)


def options(group: str, *registered: str) -> str:
    """A group's options as an error line lists them: conf/'s YAMLs (a fork's own too) and nodes registered in code."""
    return ", ".join(sorted([*(path.stem for path in (REPO / "conf" / group).glob("*.yaml")), *registered]))


@pytest.mark.parametrize("overrides,message", [
    (["model=cnnn"], "model=cnnn is not an option of model (did you mean model=cnn?); "
                     f"choose one of {options('model')}"),
    (["model=cnn", "optimizer=adamm"], "optimizer=adamm is not an option of optimizer (did you mean optimizer=adam?); "
                                       f"choose one of {options('optimizer')}"),
    (["modell=mlp"], "modell is not a config key (did you mean model?)"),  # a block the schema declares: no +KEY
    (["trainer.epoch=3"], "trainer.epoch is not a config key (did you mean trainer.epochs?)"),
    (["trainer.nothing_like_it.x=1"], "trainer.nothing_like_it is not a config key (train.py --cfg job lists the "
                                      "keys)"),
    (["trainer.epochs=abc"], "trainer.epochs=abc: trainer.epochs takes an integer, e.g. trainer.epochs=20"),
    (["trainer.grad_clip=x"], "trainer.grad_clip=x: trainer.grad_clip takes a number or null"),
    (["dist.sync_bn=maybe"], "dist.sync_bn=maybe: dist.sync_bn takes true or false, e.g. dist.sync_bn=true"),
    (["trainer.epochs=null"], "trainer.epochs=null: trainer.epochs cannot be null; "
                              "set it to an integer, e.g. trainer.epochs=20"),
    (["dist.master_port=abc"], "dist.master_port=abc: dist.master_port takes an integer or null"),
    (["model=mlp", "trainer.epochs=3", "trainer.epochs=x"], "trainer.epochs=x: trainer.epochs takes an integer, "
                                                            "e.g. trainer.epochs=3"),
    (["trainer.epochs=[1"], "cannot parse the override 'trainer.epochs=[1' (no viable alternative at input '[1'); "
     "quote values holding special characters, e.g. key='a value' "
     "(https://hydra.cc/docs/advanced/override_grammar/basic/)"),
    (["model=cnn", "model.hiden=3"], "model.hiden is not a config key (did you mean model.hidden?); "
     "src.components.models.SimpleCNN takes in_channels, image_size, num_outputs, channels, hidden, dropout"),
    (["callbacks.ema.decy=0.9"], "callbacks.ema.decy is not a config key (did you mean callbacks.ema.decay?); "
                                 "src.callbacks.ema.EMA takes decay, warmup_steps, model"),
    (["dist.cpu_offload=true"], "dist.cpu_offload is not a config key (did you mean dist.fsdp.cpu_offload?); "
                                "pass dist.fsdp.cpu_offload=true"),
    (["callbacks.decay=0.9"], "callbacks.decay is not a config key (did you mean callbacks.ema.decay?); "
                              "pass callbacks.ema.decay=0.9"),
    (["epochs=3"], "epochs is not a config key (did you mean trainer.epochs?); pass trainer.epochs=3"),
    (["logger.tracking_uri=x"], "logger.tracking_uri is not a config key (did you mean logger.mlflow.tracking_uri?); "
                                "pass logger=mlflow logger.mlflow.tracking_uri=x"),
    (["logger=mlflow", "logger.tracking_uri=x"], "logger.tracking_uri is not a config key (did you mean "
                                                 "logger.mlflow.tracking_uri?); pass logger.mlflow.tracking_uri=x"),
    (["logger.timeout_s=5"], "logger.timeout_s is not a config key (train.py --cfg job lists the keys); "
                             "to add a new key, use +logger.timeout_s=5"),
    # A group the defaults list has (experiment: null), added with +: Hydra's advice is for a defaults list.
    (["+experiment=digits_cnn"], "+experiment=digits_cnn: experiment is a group train.py chooses from already: "
                                 "drop the +"),
    (["model=mlp", "+model=cnn"], "+model=cnn: model is a group train.py chooses from already: drop the +"),
], ids=["unknown-option", "second-group", "typo-in-group", "typo-in-key", "unknown-key-no-suggestion",
        "int-expected", "float-expected", "bool-expected", "null-not-allowed", "port-not-a-number",
        "checked-after-the-overrides-before", "unparsable-override", "a-key-the-model-does-not-take",
        "a-key-the-callback-does-not-take", "one-level-down", "one-level-down-among-callbacks",
        "one-level-down-from-the-top", "one-level-down-in-an-option-not-chosen", "one-level-down-in-the-option-chosen",
        "two-blocks-hold-it-no-guess", "plus-on-a-group-chosen-by-none", "plus-on-a-group-chosen"])
def test_train_command_line(overrides, message):
    assert described(overrides) == message


@pytest.mark.parametrize("overrides,message", [
    (["checkpoint=x.pt", "dataset=nope"], "dataset=nope is not an option of dataset; choose one of "
     f"{options('dataset', 'checkpoint')}"),
    (["checkpoint=x.pt", "trainer.devic=cpu"], "trainer.devic is not a config key (did you mean trainer.device?)"),
    (["checkpoint=x.pt", "model=mlp"], "eval.py has no model option to choose; it chooses dataset=OPTION"),
    (["dataset.root=/data", "dataset.anything=1"], None),  # eval's dataset node is open: no error
], ids=["eval-unknown-option", "eval-typo-in-key", "eval-no-model", "eval-open-dataset"])
def test_eval_command_line(eval_dataset_option, overrides, message):
    if message is None:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            assert compose("eval", overrides).dataset.anything == 1
        return
    assert described(overrides, "eval", script="eval.py") == message


def test_a_key_one_level_down_in_an_option_of_a_searchpath_folder(tmp_path):
    """`hydra.searchpath` folders' options count too: a fork's own logger."""
    (tmp_path / "logger").mkdir()
    (tmp_path / "logger" / "mine.yaml").write_text("mine:\n  endpoint: null\n")
    overrides = [f"hydra.searchpath=[file://{tmp_path}]", "logger.endpoint=http://x"]
    assert described(overrides) == ("logger.endpoint is not a config key (did you mean logger.mine.endpoint?); "
                                    "pass logger=mine logger.mine.endpoint=http://x")


def test_additions_and_deletions_keep_hydras_own_message():
    for overrides in (["+trainer.epochs=3"], ["~trainer.epoch"]):
        error = error_of(overrides)
        one_line = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
        assert hydra_errors.describe_config_error(error, "train.py", overrides, "config") == one_line


@pytest.fixture(scope="module")
def conf_with_bad_files(tmp_path_factory) -> Path:
    """conf/ plus experiment files that set a key the schema lacks, a value of the wrong type, a missing option."""
    conf = tmp_path_factory.mktemp("conf") / "conf"
    shutil.copytree(REPO / "conf", conf)
    (conf / "experiment" / "bad_type.yaml").write_text("# @package _global_\ntrainer:\n  epochs: abc\n")
    (conf / "experiment" / "bad_key.yaml").write_text("# @package _global_\ntrainer:\n  epoch: 3\n")
    (conf / "experiment" / "bad_option.yaml").write_text("# @package _global_\ndefaults:\n  - override /model: cnnn\n")
    return conf


@pytest.mark.parametrize("experiment,message", [
    ("bad_type", "trainer.epochs (in experiment/bad_type.yaml): trainer.epochs takes an integer, "
                 "e.g. trainer.epochs=20"),
    ("bad_key", "trainer.epoch (in experiment/bad_key.yaml) is not a config key (did you mean trainer.epochs?)"),
    ("bad_option", "model=cnnn is not an option of model (did you mean model=cnn?); "
                   f"choose one of {options('model')}"),
])
def test_errors_in_config_files(conf_with_bad_files, experiment, message):
    assert described([f"experiment={experiment}", "trainer.epochs=3"], conf=conf_with_bad_files) == message


def reworded(error: Exception, text: str) -> Exception:
    """`error` as a future Hydra might word it: the same type, cause, attributes and traceback, another text."""
    if isinstance(error, MissingConfigException):
        new = MissingConfigException(text, missing_cfg_file=error.missing_cfg_file, options=error.options)
    else:
        new = type(error)(text)
    new.__cause__ = error.__cause__
    return new.with_traceback(error.__traceback__)


@pytest.mark.parametrize("overrides,config_name", [
    (["model=cnnn"], "config"), (["modell=mlp"], "config"), (["trainer.epoch=3"], "config"),
    (["trainer.epochs=abc"], "config"), (["trainer.epochs=null"], "config"), (["checkpoint=x.pt", "model=mlp"], "eval"),
], ids=["unknown-option", "typo-in-group", "typo-in-key", "int-expected", "null-not-allowed", "eval-no-model"])
def test_a_reworded_hydra_message_gets_the_same_description(eval_dataset_option, overrides, config_name):
    error = error_of(overrides, config_name)
    text = "Hydra 9 says something else entirely"
    as_worded = hydra_errors.describe_config_error(reworded(error, text), "x.py", overrides, config_name)
    assert as_worded == hydra_errors.describe_config_error(error, "x.py", overrides, config_name)
    assert text not in as_worded


def test_an_error_no_override_explains_keeps_hydras_message_on_one_line():
    error = ConfigCompositionException("Something Hydra says\n  over two lines")
    assert hydra_errors.describe_config_error(error, "train.py", [], "config") == "Something Hydra says over two lines"


def test_a_hydra_main_script_exits_with_one_error_line(monkeypatch, capsys):
    """The whole path of train.py: @hydra.main, the command line, exit code 2 and one `error:` line."""
    monkeypatch.setattr(sys, "argv", ["train.py", "trainer.epochs=abc"])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    main = hydra.main(version_base="1.3", config_path=str(REPO / "conf"), config_name="config")(lambda cfg: None)
    with pytest.raises(SystemExit) as exited, hydra_errors.one_line_config_errors(True, "config"):
        main()
    assert exited.value.code == USAGE_ERROR_EXIT_CODE
    assert capsys.readouterr().err == ("error: trainer.epochs=abc: trainer.epochs takes an integer, "
                                       "e.g. trainer.epochs=20\n")


def test_a_run_dir_hydra_cannot_make_is_one_error_line(monkeypatch, capsys, tmp_path):
    """Hydra makes it before the task function runs: below a file, or in a folder that takes none (/proc). (train.py's
    callback refuses the first of those earlier, with its own line: tests/unit/parallel/test_launch.py; eval.py's
    has none.)"""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text("x: 1\n")
    (tmp_path / "notes.txt").write_text("a file, not a folder\n")
    monkeypatch.setattr(sys, "argv", ["eval.py", f"hydra.run.dir={tmp_path}/notes.txt/run"])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    main = hydra.main(version_base="1.3", config_path=str(tmp_path / "conf"), config_name="config")(lambda cfg: None)
    with pytest.raises(SystemExit) as exited, hydra_errors.one_line_config_errors(True, "config"):
        main()
    assert exited.value.code == USAGE_ERROR_EXIT_CODE
    assert capsys.readouterr().err == (f"error: cannot write {tmp_path}/notes.txt/run (Not a directory): choose "
                                       "another hydra.run.dir (hydra.sweep.dir with -m)\n")


def test_a_file_error_of_the_run_itself_keeps_hydras_report(monkeypatch, capsys, tmp_path):
    def task_function(cfg):
        hydra_errors.config_composed()  # as job.start() does: from here on, the run's own errors
        (tmp_path / "missing" / "file.txt").read_text()

    monkeypatch.setattr(sys, "argv", ["train.py", f"hydra.run.dir={tmp_path}/run"])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    main = hydra.main(version_base="1.3", config_path=str(REPO / "conf"), config_name="config")(task_function)
    with pytest.raises(SystemExit) as exited, hydra_errors.one_line_config_errors(True, "config"):
        main()
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert "FileNotFoundError" in err and "missing/file.txt" in err and "error:" not in err
    assert (tmp_path / "run" / ".hydra").is_dir()
