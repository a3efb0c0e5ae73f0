"""One tracker run per training run: the `logger`s' runs, opened by rank 0 and continued across restarts, resumes
and sweep jobs by their ids (in `trackers.json` and every checkpoint). A step a restart redoes is not sent twice."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig

from src.common.files import write_text_atomically
from src.config.building import errors_named
from src.loop.callback import Callback, Outcome, Run
from src.reports.hparams import run_hparams
from src.reports.trackers import RunIdentity, Tracker

log = logging.getLogger(__name__)
IDS_FILE = "trackers.json"  # in the run dir: {"ids": {logger: run id}, "sent": {logger: {key: last step}}}


class Trackers(Callback):
    """The run's trackers by logger name (none on ranks other than 0), as one callback."""

    def __init__(self, trackers: Mapping[str, Tracker], identity: RunIdentity, overrides: Sequence[str] = (),
                 choices: Mapping[str, Any] | None = None) -> None:
        self.trackers, self.identity = dict(trackers), identity
        self.overrides, self.choices = tuple(overrides), dict(choices or {})
        self.ids: dict[str, str] = {}  # each tracker's run id, from the checkpoint and then from `open`
        self.sent: dict[str, dict[str, int]] = {}  # the last step each tracker holds of each key
        self._ledger: set[str] = set()  # the trackers whose `sent` only trackers.json knows
        self._status: tuple[str, str | None] | None = None  # how the run ended, when `close` comes
        self._last_step, self._open = 0, False
        self._params: dict[str, Any] | None = None  # the run's hyperparameters, until the trackers' runs open

    def state_dict(self) -> dict[str, Any]:
        return {"ids": dict(self.ids)} if self.ids else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.ids = dict(state.get("ids", {}))

    def on_run_start(self, run: Run) -> None:
        """The hyperparameters for the trackers' runs, which open with the first scalars (after a resume's ids)."""
        if not self.trackers:
            self.enabled = False  # not rank 0, or no tracker but TensorBoard
            return
        self._params = run_hparams(run.parts.saved_config, self.overrides, self.choices,
                                   run.parts.data.train_sampler.global_batch_size)

    def _open_runs(self) -> None:
        """Open each tracker's run: the one the checkpoint or the run dir names, else a new one."""
        params, self._params = self._params, None
        if params is None:
            return
        ids_file = self.identity.run_dir / IDS_FILE
        saved = json.loads(ids_file.read_text()) if ids_file.exists() else {}
        known = {**saved.get("ids", {}), **self.ids}
        for name, tracker in self.trackers.items():
            if (run_id := tracker.open(known.get(name), self.identity, params)) is not None:
                self.ids[name] = run_id
            if (held := tracker.sent_steps()) is None:
                self._ledger.add(name)
                held = saved.get("sent", {}).get(name, {}) if known.get(name) == run_id else {}
            self.sent[name] = dict(held)
        self._open = True
        self._write_ids_file()

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        """Send each scalar to each tracker that does not hold its key at `step` yet."""
        self._open_runs()
        if not self._open:
            return
        self._last_step = max(self._last_step, step)
        for name, tracker in self.trackers.items():
            sent = self.sent[name]
            if fresh := {key: value for key, value in scalars.items() if step > sent.get(key, -1)}:
                tracker.log(fresh, step)
                sent.update(dict.fromkeys(fresh, step))
        if self._ledger:
            self._write_ids_file()

    def log_final(self, final_metrics: Mapping[str, float]) -> None:
        """The finished run's final metrics, as `final/<metric>` at its last step."""
        self.log({f"final/{key}": value for key, value in final_metrics.items()}, self._last_step)

    def on_run_end(self, run: Run, outcome: Outcome) -> None:
        stop_reason = run.state.ended.reason if run.state.ended is not None else outcome.value
        self._status = ("FINISHED" if outcome.is_final else "KILLED", stop_reason)

    def on_exception(self, run: Run, error: BaseException) -> None:
        self._status = ("FAILED", type(error).__name__)
        self.close()

    def close(self) -> None:
        self._open_runs()
        if not self._open:
            return
        status, stop_reason = self._status or ("FAILED", None)
        self._open = False
        for name, tracker in self.trackers.items():
            try:
                tracker.close(status, stop_reason)
            except Exception as error:  # a server gone: the run's own error (if any) is the one to see
                log.warning("logger %s: could not end its run as %s: %s", name, status, error)

    def _write_ids_file(self) -> None:
        ledger = {name: self.sent[name] for name in sorted(self._ledger)}
        write_text_atomically(self.identity.run_dir / IDS_FILE, json.dumps({"ids": self.ids, "sent": ledger}) + "\n")


def identity_of(run_dir: Path, in_sweep: bool) -> RunIdentity:
    """A run's name, and a sweep job's group: its sweep dir (the job dir's parent, hydra.sweep.dir)."""
    group, job = (str(run_dir.parent), run_dir.name) if in_sweep else (None, None)
    return RunIdentity(str(run_dir), run_dir, group=group, job=job)


def build_trackers(logger_cfg: DictConfig, context: Any, is_main_process: bool) -> Trackers:
    """The trackers `logger` names besides TensorBoard, built by rank 0 alone, before any work."""
    built = {}
    for name, node in logger_cfg.items():
        if is_main_process and name != "tensorboard":  # TensorBoard is the Reporter's own
            with errors_named(f"logger.{name}", node):
                built[str(name)] = instantiate(node)
    return Trackers(built, identity_of(context.run_dir, context.in_sweep), context.overrides, context.choices)
