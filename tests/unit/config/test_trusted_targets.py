"""Checkpoints are data, never code: a `_target_` in a checkpoint's saved config that the user
did not trust is refused before anything is built (the real CLI: tests/integration/test_trusted_targets_cli.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from src.common.errors import UsageError
from src.config import trusted_targets


def test_targets_are_found_at_any_depth():
    config = {"model": {"_target_": "a.B", "net": {"_target_": "c.D"}}, "list": [{"_target_": "e.F"}], "x": 1}
    assert list(trusted_targets.targets_in(config)) == [
        ("model._target_", "a.B"), ("model.net._target_", "c.D"), ("list.0._target_", "e.F")]


def test_the_config_groups_targets_are_trusted_and_a_missing_group_is_skipped(tmp_path: Path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text("_target_: my_pkg.MyModel\nwidth: 3\n")
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "x.yaml").write_text("# @package _global_\nmodel:\n  _target_: my_pkg.Other\n")
    assert trusted_targets.targets_of_config_groups([tmp_path]) == {"my_pkg.MyModel", "my_pkg.Other"}
    shipped = trusted_targets.targets_of_config_groups([trusted_targets.DEFAULT_CONF])
    assert {"src.components.models.SimpleCNN", "src.components.datasets.digits", "torch.optim.AdamW"} <= shipped


def test_an_untrusted_target_is_one_line_naming_it_and_the_way_to_allow_it(tmp_path: Path):
    saved = {"model": {"_target_": "src.components.models.SimpleCNN"}, "dataset": {"_target_": "torch.load", "f": "x"}}
    with pytest.raises(UsageError) as error:
        trusted_targets.check_saved_config(saved, tmp_path / "a.pt", trusted_targets.trusted([]))
    message = str(error.value)
    assert "dataset._target_=torch.load" in message and "trusted_targets=[torch.load]" in message
    assert "SimpleCNN" not in message and "\n" not in message
    trusted_targets.check_saved_config(saved, tmp_path / "a.pt", trusted_targets.trusted(["torch.load"]))


def test_an_interpolation_that_would_build_a_target_is_refused(tmp_path: Path):
    saved = {"model": "${oc.create:{_target_: builtins.print, _args_: [pwned]}}"}
    with pytest.raises(UsageError, match="holds the interpolation model="):
        trusted_targets.check_saved_config(saved, tmp_path / "a.pt", trusted_targets.trusted(["builtins.print"]))
    with pytest.raises(UsageError, match="holds no saved config"):  # OmegaConf.create would parse a YAML string
        trusted_targets.check_saved_config("model: {_target_: builtins.print}", tmp_path / "a.pt", set())
