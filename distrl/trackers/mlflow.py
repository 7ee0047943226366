"""MLflow: one MLflow run per distrl run, through `MlflowClient` (no global active run in the driver's process).

The resolved config is logged twice: flattened into params (`rollout.sampling.temperature`), which MLflow can
search, and whole as the artifact `config.yaml`. MLflow refuses to change a param, so a resumed run adds only
params it did not have and replaces `config.yaml`. Every step's row is one `log_batch` with `step` as the metrics'
step; a step logged again after a resume (those after the checkpoint it continues from) gets a second value at that
step. MLflow stores no null (skipped) and writes an infinity as the largest float.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import yaml

from distrl.config import MlflowConfig
from distrl.trackers.base import EndState, Tracker

STATUS: dict[EndState, str] = {"finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}
# MLflow's metric and param names: letters, digits, `_ - . : /` and spaces.
NOT_IN_NAME = re.compile(r"[^\w\-.:/ ]")


def metric_name(key: str) -> str:
    """`key` as MLflow accepts it: `.../staleness_4+` -> `.../staleness_4plus`, `eval/gsm8k/pass@4` ->
    `eval/gsm8k/pass_at_4`, any other character MLflow refuses -> `_`."""
    return NOT_IN_NAME.sub("_", key.replace("+", "plus").replace("@", "_at_"))


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"a": {"b": 1}, "c": [1, 2]}` -> `{"a.b": "1", "c": "[1, 2]"}`: the params MLflow keeps (strings)."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[metric_name(f"{prefix}{key}")] = value if isinstance(value, str) else json.dumps(value)
    return flat


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, settings: MlflowConfig, run_name: str):
        self.settings, self.run_name = settings, run_name

    def start(self, config: dict[str, Any], run_id: str | None) -> str:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        self.client = MlflowClient(self.settings.tracking_uri)
        params = flatten(config)
        if run_id is None:
            experiment = self.client.get_experiment_by_name(self.settings.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(self.settings.experiment))
            run_id = self.client.create_run(experiment_id, tags=self.settings.tags, run_name=self.run_name).info.run_id
        else:
            params = {k: v for k, v in params.items() if k not in self.client.get_run(run_id).data.params}
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        # The whole config is in config.yaml; a param longer than MLflow keeps is cut there.
        self.client.log_batch(run_id, params=[Param(k, v[:MAX_PARAM_VAL_LENGTH]) for k, v in params.items()])
        self.client.log_text(run_id, yaml.safe_dump(config, sort_keys=False), "config.yaml")
        return run_id

    def log(self, step: int, row: dict[str, float | None]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(metric_name(k), v, now, step)
                                                    for k, v in row.items() if v is not None])

    def finish(self, state: EndState) -> None:
        self.client.set_terminated(self.run_id, STATUS[state])
