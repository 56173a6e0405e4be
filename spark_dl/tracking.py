"""Optional run tracking beyond the run directory: TensorBoard and MLflow.

Every fit writes its run directory (``spark_dl.runs``) whatever is chosen here; ``track=``
adds the same figures, as they arrive on the driver, to

- ``"tensorboard"``: event files in ``<run_dir>/tensorboard`` (``tensorboard --logdir runs``);
  scalars ``step/loss``, ``step/samples_per_s`` (and ``step/staleness`` for Downpour) against the
  step count of replica 0, and ``epoch/<metric>`` against the epoch.
- ``"mlflow"``: the active MLflow run, or a new one named after the run directory, in whatever
  ``MLFLOW_TRACKING_URI`` / ``mlflow.set_tracking_uri`` points at; the fit's configuration as
  parameters, per-epoch metrics with ``step=epoch``, the run directory's files (history,
  plot, config, info, model) as artifacts when the fit ends, and the fitted model as an MLflow
  PyTorch model under the artifact path ``model`` (``FitResult.mlflow_run_id`` names the run):
  ``mlflow.pyfunc.load_model(f"runs:/{run_id}/model")`` predicts on a pandas DataFrame whose
  one column holds the feature rows as fit reads them (arrays of ``prod(shape)`` floats, or
  lists), and ``mlflow.pyfunc.spark_udf(spark, f"runs:/{run_id}/model")`` scores such an
  array<float> column. Its signature comes from a few training rows (the validation rows, or
  the first rows fit reads to check the DataFrame is not empty): the input a tensor of
  (rows, ``*shape``) in the fit's dtype, which the pandas column's flat rows are reshaped to;
  the output the model's per row (an array of floats, e.g. a classifier's scores). The model
  is pickled (``serialization_format="pickle"``): where it is loaded, its class must import
  (spark_dl for its models, your module for your own).

Neither package is required: ``pip install 'spark_dl[tracking]'`` installs both.
"""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path

import numpy as np

from .errors import ConfigError, SparkDLError

__all__ = ["TRACKERS", "Tracker"]

TRACKERS = ("tensorboard", "mlflow")
_ARTIFACTS = ("config.json", "history.csv", "info.json", "loss.png", "model.pt")
MODEL_PATH = "model"          # the MLflow model's artifact path in the run
EXAMPLE_ROWS = 4              # training rows the MLflow model's signature is made from


def _names(track) -> tuple[str, ...]:
    if track is None or track == ():
        return ()
    names = (track,) if isinstance(track, str) else tuple(track)
    bad = [n for n in names if n not in TRACKERS]
    if bad:
        raise ConfigError(f"track={track!r}: unknown tracker(s) {bad}; choose from "
                          f"{list(TRACKERS)} (or None: the run directory only)")
    return tuple(dict.fromkeys(names))


def _flat(config: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)[:500]          # MLflow caps a value's length
    return out


class Tracker:
    """The trackers of one fit. ``Tracker(track)`` only checks the names and that the packages
    import; ``start(run_dir, config)`` opens them, ``step``/``epoch`` log, ``close()`` ends."""

    def __init__(self, track):
        self.names = _names(track)
        self.run_dir = Path(".")
        self._tb = None
        self._mlflow = None
        self._own_mlflow_run = False
        self.mlflow_run_id: str | None = None      # the MLflow run, once started
        self._steps = 0
        self._epochs: set = set()
        for name in self.names:
            module = {"tensorboard": "torch.utils.tensorboard", "mlflow": "mlflow"}[name]
            try:
                __import__(module)
            except ImportError as e:
                raise ConfigError(f"track={name!r} needs the {name} package, which does not "
                                  f"import here ({e}); pip install 'spark_dl[tracking]' or "
                                  f"drop {name!r} from track") from e

    def start(self, run_dir: Path, config: dict) -> Tracker:
        self.run_dir = Path(run_dir)
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            self._tb.add_text("config", "```\n" + json.dumps(config, indent=1, default=str)
                              + "\n```")
        if "mlflow" in self.names:
            import mlflow
            from mlflow.tracking import MlflowClient
            run = mlflow.active_run()
            if run is None:
                run = mlflow.start_run(run_name=self.run_dir.name)
                self._own_mlflow_run = True
            # metrics arrive on the driver's message thread, where mlflow's (thread-local)
            # active run is not set: log through the client, by run id
            self._mlflow = (MlflowClient(), run.info.run_id)
            self.mlflow_run_id = run.info.run_id
            mlflow.log_params(_flat(config))
            mlflow.set_tag("spark_dl.run_dir", str(self.run_dir))
        return self

    def step(self, m: dict) -> None:
        """A progress message of replica/worker 0 (loss, samples/s, staleness)."""
        if self._tb is None:
            return
        self._steps += 1
        for key in ("loss", "samples_per_s", "staleness"):
            if isinstance(m.get(key), (int, float)):
                self._tb.add_scalar(f"step/{key}", m[key], self._steps)

    def epoch(self, row: dict) -> None:
        """One history row: every numeric entry but the epoch itself. An epoch already logged
        (a retried task reports its epochs again) is skipped."""
        if row["epoch"] in self._epochs:
            return
        self._epochs.add(row["epoch"])
        scalars = {k: float(v) for k, v in row.items()
                   if k != "epoch" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(f"epoch/{k}", v, row["epoch"])
            self._tb.flush()
        if self._mlflow is not None:
            from mlflow.entities import Metric
            client, run_id = self._mlflow
            now = int(time.time() * 1000)
            client.log_batch(run_id, metrics=[Metric(k, v, now, int(row["epoch"]))
                                              for k, v in scalars.items()])

    @property
    def wants_model(self) -> bool:
        """Whether the fitted model goes to a tracker (MLflow), which needs example rows."""
        return "mlflow" in self.names

    def log_model(self, net, example) -> None:
        """The fitted model as an MLflow PyTorch model under ``MODEL_PATH`` of the run, its
        signature from ``example`` (a few rows as the model takes them, a numpy array in its
        dtype); logged in eval mode (what serving runs), ``net`` left in its own mode after.
        Nothing without MLflow."""
        if self._mlflow is None or example is None:
            return
        import mlflow.pytorch
        import torch

        import spark_dl
        run_id = self._mlflow[1]
        training = net.training
        try:
            net.eval()
            with torch.no_grad():
                out = net(torch.from_numpy(np.ascontiguousarray(example)))
            # pickled ("pt2" would trace the model; an MLflow without the argument pickles)
            pickle = {"serialization_format": "pickle"} if "serialization_format" in \
                inspect.signature(mlflow.pytorch.log_model).parameters else {}
            mlflow.pytorch.log_model(
                net, name=MODEL_PATH, run_id=run_id, signature=_signature(example, out),
                **pickle, pip_requirements=[*mlflow.pytorch.get_default_pip_requirements(),
                                  f"spark_dl=={spark_dl.__version__}"])
        except Exception as e:
            raise SparkDLError(f"the fitted model could not be logged to MLflow run {run_id} "
                               f"({type(e).__name__}: {e}); the run directory {self.run_dir} "
                               f"holds it (model.pt)") from e
        finally:
            net.train(training)

    def close(self, failed: bool = False) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._mlflow is not None:
            import mlflow
            client, run_id = self._mlflow
            for name in _ARTIFACTS:
                if (self.run_dir / name).exists():
                    client.log_artifact(run_id, str(self.run_dir / name))
            if self._own_mlflow_run:
                mlflow.end_run(status="FAILED" if failed else "FINISHED")
            self._mlflow = None


def _signature(example: np.ndarray, out):
    """The MLflow signature of a model that gives ``out`` for the rows ``example``: a tensor of
    (rows, *one row's shape) in, and per row out what ``spark_udf`` returns: a number, an
    array of them (a classifier's scores), or for more dimensions a tensor."""
    import torch
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, Schema, TensorSpec
    from mlflow.types.schema import Array

    inputs = Schema([TensorSpec(example.dtype, (-1, *example.shape[1:]))])
    if not isinstance(out, torch.Tensor):
        return ModelSignature(inputs=inputs)
    out = out.detach().cpu().numpy()
    kind = DataType.double if out.dtype == np.float64 else DataType.float
    outputs = Schema([ColSpec(kind)]) if out.ndim == 1 else \
        Schema([ColSpec(Array(kind))]) if out.ndim == 2 else \
        Schema([TensorSpec(out.dtype, (-1, *out.shape[1:]))])
    return ModelSignature(inputs=inputs, outputs=outputs)
