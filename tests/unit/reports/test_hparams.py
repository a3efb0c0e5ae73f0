"""Which settings a run records as HParams: what its command line set, and a few chosen ones."""

from __future__ import annotations

from src.reports.hparams import changed_settings, flatten, run_hparams

CONFIG = {
    "task": {"_target_": "src.components.tasks.Classification"},
    "model": {"_target_": "src.components.models.SimpleCNN", "channels": 32, "dropout": 0.1},
    "dataset": {"_target_": "src.components.datasets.Digits", "batch_size": 64, "num_workers": 0, "split_seed": 0},
    "optimizer": {"_target_": "torch.optim.SGD", "lr": 0.05, "momentum": 0.9},
    "scheduler": {"_target_": "src.loop.optim.cosine"},
    "trainer": {"epochs": 3, "precision": "fp32", "ema": {"decay": 0.999, "warmup_steps": 10}},
    "seed": 1,
    "resume": None,
}
CHOICES = {"task": "classification", "model": "cnn", "dataset": "digits", "optimizer": "sgd",
           "scheduler": "cosine", "dist": "ddp", "experiment": None, "hydra/launcher": "basic"}
ALWAYS = {"task": "classification", "model": "cnn", "dataset": "digits", "optimizer": "sgd", "scheduler": "cosine",
          "optimizer.lr": 0.05, "trainer.epochs": 3, "seed": 1, "global_batch_size": 128}


def test_a_run_without_overrides_records_only_the_chosen_settings():
    assert run_hparams(CONFIG, [], CHOICES, 128) == ALWAYS


def test_overridden_keys_groups_and_blocks_are_recorded_with_the_values_used():
    overrides = ["optimizer=sgd", "model.dropout=0.1", "trainer.ema=\"{decay: 0.999, warmup_steps: 10}\"",
                 "+trainer.precision=fp32", "~dataset.split_seed", "dataset.batch_size=64"]
    hparams = run_hparams(CONFIG, overrides, CHOICES, 128)
    assert hparams == {**ALWAYS, "model.dropout": 0.1, "trainer.ema.decay": 0.999, "trainer.ema.warmup_steps": 10,
                       "trainer.precision": "fp32", "dataset.batch_size": 64}
    # None of the config's constant keys: no _target_, num_workers or split_seed columns.
    assert not [key for key in hparams if key.endswith(("_target_", "num_workers", "split_seed"))]


def test_a_group_override_outside_the_chosen_ones_is_recorded_by_option_name():
    assert run_hparams(CONFIG, ["hydra/launcher=basic"], CHOICES, 128)["hydra/launcher"] == "basic"


def test_flatten_turns_nested_config_into_dotted_scalars():
    flat = flatten({"optimizer": {"lr": 0.1, "betas": [0.9, 0.99]}, "seed": 0, "resume": None})
    assert flat == {"optimizer.lr": 0.1, "optimizer.betas": "[0.9, 0.99]", "seed": 0, "resume": "None"}


def test_where_the_run_reports_is_no_hyperparameter():
    config = {**CONFIG, "logger": {"csv": {"_target_": "src.reports.trackers.csv_file.CSVTracker",
                                           "filename": "scalars.csv"}}}
    overrides = ["logger=[tensorboard,csv]", "logger.csv.filename=scalars.csv", "model.dropout=0.1"]
    assert run_hparams(config, overrides, {**CHOICES, "logger": "[tensorboard,csv]"}, 128) == {
        **ALWAYS, "model.dropout": 0.1}


def test_the_settings_a_resume_changes_are_named_with_their_old_values():
    saved = {"resume": None, "seed": 0, "optimizer": {"lr": 0.1, "betas": [0.9, 0.99]}, "trainer": {"max_steps": 27},
             "callbacks": {"ema": {"decay": 0.9}}}
    current = {"resume": "auto", "seed": 0, "optimizer": {"lr": 0.01, "betas": [0.9, 0.99]},
               "trainer": {"max_steps": None}, "callbacks": {}}
    assert changed_settings(saved, current) == [
        "callbacks.ema.decay=unset (was 0.9)", "optimizer.lr=0.01 (was 0.1)", "trainer.max_steps=None (was 27)"]
    assert changed_settings(saved, {**saved, "resume": "auto"}) == []  # `resume` is how the run goes on, not what
    assert changed_settings(saved, {**saved, "optimizer": {"lr": 0.1, "betas": [0.9, 0.999]}}) == [
        "optimizer.betas=[0.9, 0.999] (was [0.9, 0.99])"]
