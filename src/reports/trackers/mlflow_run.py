"""logger=mlflow: the run as one MLflow run, through `MlflowClient` (not the process-global active run: a
multirun's jobs share one process); a server that does not answer `/health` is one error line."""

from __future__ import annotations

import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from src.common.errors import UsageError
from src.reports.trackers import RunIdentity, Tracker, import_package

log = logging.getLogger(__name__)
INSTALL = "mlflow-skinny==3.17.2 (a client of an `mlflow server`; the full mlflow==3.17.2 for a local store)"


class MLflowTracker(Tracker):
    def __init__(self, tracking_uri: str | None = None, experiment_name: str = "ddp-hydra-template",
                 timeout_s: float = 10.0) -> None:
        # The client's own retries would outlast a short timeout many times over.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(max(timeout_s, 1))))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        self.mlflow = import_package("mlflow", "mlflow", INSTALL)  # with its client and entities
        if tracking_uri and tracking_uri.startswith(("http://", "https://")):  # one line, before any work
            try:
                with urllib.request.urlopen(f"{tracking_uri.rstrip('/')}/health", timeout=timeout_s) as response:
                    response.read()
            except (urllib.error.URLError, OSError) as error:
                raise UsageError(f"logger.mlflow.tracking_uri={tracking_uri} does not answer ({error}): start the "
                                 "server, or choose another tracking_uri") from None
        self.client = self.mlflow.tracking.MlflowClient(tracking_uri=tracking_uri or None)
        self.experiment_name, self.run_id = experiment_name, None

    def open(self, run_id: str | None, identity: RunIdentity, params: Mapping[str, Any]) -> str:
        if run_id is not None and self._continues(run_id):  # a restart, resume=auto, a resumed sweep job
            self.run_id = run_id
            return run_id
        tags = {"run_dir": str(identity.run_dir)}
        if identity.group is not None:
            tags.update(sweep=identity.group, sweep_job=str(identity.job))
        self.run_id = self.client.create_run(self._experiment_id(), run_name=identity.name, tags=tags).info.run_id
        param = self.mlflow.entities.Param
        self.client.log_batch(self.run_id, params=[param(key, str(value)) for key, value in params.items()])
        return self.run_id

    def _continues(self, run_id: str) -> bool:
        """Set the run `run_id` RUNNING again; False (with a warning) if this tracking server has no such run."""
        try:
            self.client.get_run(run_id)
        except self.mlflow.exceptions.MlflowException as error:
            log.warning("MLflow run %s is not on %s (%s): this run starts a new one", run_id,
                        self.client.tracking_uri, error.error_code)
            return False
        self.client.update_run(run_id, status="RUNNING")
        return True

    def _experiment_id(self) -> str:
        if (experiment := self.client.get_experiment_by_name(self.experiment_name)) is None:
            try:
                return self.client.create_experiment(self.experiment_name)
            except Exception:  # another job created it meanwhile
                if (experiment := self.client.get_experiment_by_name(self.experiment_name)) is None:
                    raise
        return experiment.experiment_id

    def sent_steps(self) -> dict[str, int]:
        assert self.run_id is not None
        keys = self.client.get_run(self.run_id).data.metrics
        return {key: max(m.step for m in self.client.get_metric_history(self.run_id, key)) for key in keys}

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        now, metric = int(time.time() * 1000), self.mlflow.entities.Metric
        self.client.log_batch(self.run_id, metrics=[metric(key, float(v), now, step) for key, v in scalars.items()])

    def close(self, status: str, stop_reason: str | None) -> None:
        if self.run_id is None:
            return
        if stop_reason is not None:
            self.client.set_tag(self.run_id, "stop_reason", stop_reason)
        self.client.set_terminated(self.run_id, status)
        self.run_id = None
