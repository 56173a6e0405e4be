"""``spark_dl.fit``'s options, each declared once: name, type, default, check, one-line doc.

Made from OPTIONS:

- ``fit``'s checks (``Option.check``), what it hands the tasks (``to``: StageConfig's fields,
  the replicas' optimizer, or fit's own) and the option list of ``help(spark_dl.fit)``;
- the jobs' TOML ``[train]`` table (``spark_dl.config.TrainConfig``): a key for each option
  ``on`` "toml", checked as fit checks it;
- TorchEstimator's Params (``spark_dl.ml``): one for each option ``on`` "param", in camelCase
  (``batch_size`` -> ``batchSize``; PARAM_NAMES where not), with its ``__init__`` and
  ``setParams`` keywords.

A surface's default, where it is not fit's, is in TOML_DEFAULTS or PARAM_DEFAULTS with the
reason; NONE_AS is what stands for fit's None where a TOML file or a Param cannot hold one.

fit's signature stays written out keyword by keyword, so that IDEs, ``help`` and the API
reference show it: tests/unit/test_options.py checks it against OPTIONS (names, order,
defaults), and so StageConfig's and LocalStepConfig's fields (``spark_dl.runtime.stage``),
TrainConfig's keys and TorchEstimator's Params. Adding an option: its Option here and its use
(fit's keyword and the code that reads it), nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import textwrap
from collections.abc import Callable
from typing import Any

from .errors import ConfigError
from .optim.clip import check_grad_clip
from .optim.factory import OPTIMIZERS
from .optim.schedule import check_lr_scaling
from .strategies import STRATEGIES
from .strategies.base import Strategy

__all__ = ["NONE_AS", "OPTIONS", "PARAM_DEFAULTS", "PARAM_NAMES", "TOML_DEFAULTS", "Option",
           "default", "describe", "on", "param_name", "to_fit"]

_PLAIN = (bool, int, float, str, tuple)       # what a TOML file and a Param hold as such


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of ``fit``: ``ok(value)`` and ``must`` (the error says "<name> must be
    <must>, got <value>") or ``verify(value)`` (raises its own error, naming the option)."""

    name: str
    type: type | tuple                  # what fit takes (NoneType where None means something)
    default: Any
    doc: str                            # one line: what it does
    ok: Callable[[Any], bool] | None = None
    must: str = ""
    verify: Callable[[Any], None] | None = None
    to: str = "fit"                     # "stage" (StageConfig), "train" (the optimizer), "fit"
    on: tuple = ()                      # also "toml" (a [train] key), "param" (a Param)

    @property
    def types(self) -> tuple:
        return self.type if isinstance(self.type, tuple) else (self.type,)

    def check(self, value, table: str = "") -> None:
        """A ConfigError for a bad ``value``; ``table`` ("train"): a TOML key's table."""
        if self.verify is not None:
            try:
                self.verify(value)
            except ConfigError as e:
                if table:
                    raise ConfigError(f"{table}.{e}") from None
                raise
        elif self.ok is not None and not self.ok(value):
            key = f"'{table}.{self.name}'" if table else self.name
            raise ConfigError(f"{key} must be {self.must}, got {value!r}")

    def cast(self, value):
        """``value`` as fit hands it on: a float option's as a float, a tuple's as a tuple."""
        if self.type in (float, tuple, bool) and value is not None:
            return self.type(value)
        return value

    def plain_types(self) -> tuple:
        """The types a TOML file or a Param holds this option in (an object: a table)."""
        types = tuple(t for t in self.types if t is not type(None))
        return tuple(t if t in _PLAIN else dict for t in types)

    def toml_type(self):
        return functools.reduce(operator.or_, self.plain_types())


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _data(value) -> None:
    from .data.stream import DATA_MODES
    if value not in DATA_MODES:
        raise ConfigError(f"data must be one of {', '.join(DATA_MODES)}, got {value!r}")


def _shuffle_buffer(value) -> None:
    from .data.stream import parse_buffer
    parse_buffer(value)


def _transform(value) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"transform must be a function (x, y) -> (tensor, tensor), got "
                        f"{type(value).__name__}")


_NONE = type(None)
_STRATEGY_NAMES = ", ".join(map(repr, STRATEGIES))

OPTIONS: tuple[Option, ...] = (
    Option("strategy", (str, Strategy), "allreduce",
           f"how the replicas share what they learn: a strategy's name ({_STRATEGY_NAMES}: "
           f"its defaults) or, in fit, a strategy object such as Downpour(n_push=4)",
           on=("toml", "param")),
    Option("features", str, "features", "the DataFrame's feature column (array<float>, a "
           "fixed-size list or a Spark ML vector)", to="stage", on=("param",)),
    Option("label", str, "label", "the DataFrame's label column (a classifier's: class ids, "
           "integers or doubles holding whole numbers)", to="stage", on=("param",)),
    Option("shape", tuple, (), "one sample's shape, to which the feature rows are reshaped",
           to="stage", on=("param",)),
    Option("label_shape", tuple, (), "one label's shape (() for a class or a number)",
           to="stage"),
    Option("num_classes", (int, _NONE), None, "the number of classes, checked against the "
           "model's outputs and the labels (None: not checked)", to="stage", on=("param",)),
    Option("loss", (str, Callable), "cross_entropy", "'cross_entropy', 'mse' or a callable "
           "(output, target) -> loss", to="stage"),
    Option("optimizer", str, "sgd", "the replicas' optimizer (Downpour's and Boosting's: their "
           "server's)", lambda v: v in OPTIMIZERS, f"one of {', '.join(OPTIMIZERS)}",
           to="train", on=("toml", "param")),
    Option("lr", float, 0.01, "the learning rate of one replica's mini-batch of batch_size "
           "rows", lambda v: _number(v) and v > 0, "> 0", to="train", on=("toml", "param")),
    Option("lr_decay", float, 1.0, "lr is multiplied by it after every epoch",
           lambda v: _number(v) and 0 < v <= 1, "in (0, 1] (a per-epoch factor)", to="train"),
    Option("lr_scaling", (str, _NONE), "auto", "how lr follows an update of k mini-batches: "
           "'linear', 'sqrt', None (as given) or 'auto' (by optimizer); "
           "see spark_dl.optim.schedule", verify=lambda v: check_lr_scaling(v, "auto", 1),
           to="train", on=("toml", "param")),
    Option("warmup_epochs", (float, str), "auto", "epochs of linear warmup from lr to the "
           "scaled rate ('auto': growing with log2 k)",
           verify=lambda v: check_lr_scaling(None, v, math.inf), to="train",
           on=("toml", "param")),
    Option("grad_clip", (float, str, _NONE), "auto", "AllReduce's and Gossip's cut of the "
           "gradient norm: a maximum, None (off) or 'auto' (while lr is scaled); see "
           "spark_dl.optim.clip", verify=check_grad_clip, to="train", on=("toml", "param")),
    Option("momentum", float, 0.0, "SGD's momentum", lambda v: _number(v) and 0 <= v < 1,
           "in [0, 1)", to="train", on=("toml", "param")),
    Option("nesterov", bool, False, "SGD's momentum in Nesterov's form (the barrier-stage "
           "strategies; needs momentum > 0)", lambda v: v in (False, True), "True or False", to="train",
           on=("toml", "param")),
    Option("weight_decay", float, 0.0, "the optimizer's weight decay (L2 penalty)",
           to="train"),
    Option("max_iter", int, 3, "iterations per step of the line-search optimizers (lbfgs, "
           "cg)", _count, "an integer >= 1", to="train"),
    Option("epochs", int, 1, "passes over the data", _count, "an integer >= 1", to="stage",
           on=("toml", "param")),
    Option("batch_size", int, 64, "rows per replica and step (AllReduce's accumulate "
           "micro-batches make one step)", _count, "an integer >= 1", to="stage",
           on=("toml", "param")),
    Option("replicas", (int, _NONE), None, "how many replicas train (None: the DataFrame's "
           "partitions, at most the cluster's task slots); the data is repartitioned to them",
           lambda v: v is None or _count(v), "an integer >= 1 or None", on=("toml", "param")),
    Option("shuffle", bool, True, "shuffle each replica's rows every epoch", to="stage"),
    Option("seed", int, 0, "the seed of the weights and the shuffles (each replica derives "
           "its own from it)", to="stage", on=("toml", "param")),
    Option("dtype", str, "float32", "'float32' or 'float64' (for exactness checks)",
           lambda v: v in ("float32", "float64"), "'float32' or 'float64'", to="stage"),
    Option("device", str, "auto", "'auto' (the GPU Spark assigned to the task, else the CPU), "
           "'cpu' or 'cuda'", lambda v: v in ("auto", "cpu", "cuda"), "'auto', 'cpu' or "
           "'cuda'", to="stage"),
    Option("threads", int, 0, "torch threads per task (0: the task's Spark cores)",
           to="stage"),
    Option("validation", (tuple, _NONE), None, "(x, y) numpy arrays evaluated after every "
           "epoch, on the model the strategy returns"),
    Option("validate_every", float, 1.0, "also validate every this fraction of an epoch, "
           "into info['evals']", lambda v: _number(v) and 0 < v <= 1,
           "a fraction of an epoch in (0, 1]", to="stage"),
    Option("run_dir", (str, _NONE), None, "where config, metrics, history, plot and "
           "checkpoints go (None: runs/<strategy>-<time>-<id>)"),
    Option("resume", bool, True, "a run_dir holding a checkpoint goes on from it", to="stage"),
    Option("progress", bool, True, "a progress line on the driver while the replicas train"),
    Option("log", (Callable, _NONE), print, "where fit's messages go (None: nowhere)"),
    Option("timeout_s", float, 300.0, "seconds the replicas wait for each other to start",
           to="stage"),
    Option("data", str, "auto", "how a task holds its partition: 'memory', 'stream' (spilled "
           "to local disk, read back through a shuffle buffer) or 'auto' (by its size)",
           verify=_data, to="stage"),
    Option("shuffle_buffer", (int, str), "256MB", "a streamed partition's shuffle buffer: "
           "rows (int) or a size ('256MB')", verify=_shuffle_buffer, to="stage"),
    Option("transform", (Callable, _NONE), None, "transform(x, y) -> (x_tensor, y_tensor) on "
           "each mini-batch's numpy rows, instead of the default conversion",
           verify=_transform, to="stage"),
    Option("track", (str, list, _NONE), None, "None, 'tensorboard', 'mlflow' or both in a "
           "list: the run's figures also go there"),
)

# A surface's own defaults, where they are not fit's.
TOML_DEFAULTS = {
    "strategy": "single",   # a job's default: one process, no Spark stage (config.py)
    "batch_size": 16,       # the thesis CNN's mini-batch, which the jobs reproduce
    "lr": 0.05,             # with momentum 0.9: the jobs' SGD for the thesis CNN
    "momentum": 0.9,
}
PARAM_DEFAULTS = {
    "lr": 0.05,             # as the jobs' (TOML_DEFAULTS)
    "momentum": 0.9,
    "num_classes": 2,       # the Estimator builds its network, which needs its output width
}
NONE_AS = {"replicas": 0}   # TOML and Params hold no None: 0 is fit's None
PARAM_NAMES = {"shape": "inputShape", "features": "featuresCol", "label": "labelCol"}


def on(surface: str) -> tuple[Option, ...]:
    """The options a surface ("toml", "param") has, in fit's order."""
    return tuple(o for o in OPTIONS if surface in o.on)


def default(option: Option, surface: str):
    """``option``'s default on ``surface`` ("toml", "param")."""
    own = TOML_DEFAULTS if surface == "toml" else PARAM_DEFAULTS
    if option.name in own:
        return own[option.name]
    if option.default is None and option.name in NONE_AS:
        return NONE_AS[option.name]
    return list(option.default) if surface == "param" and option.default == () else \
        option.default


def to_fit(option: Option, value):
    """A TOML key's or a Param's value as fit takes it (NONE_AS back to None)."""
    return None if option.name in NONE_AS and value == NONE_AS[option.name] else value


def param_name(option: Option) -> str:
    """The Param of ``option``: ``batch_size`` -> ``batchSize`` (or PARAM_NAMES')."""
    head, *rest = option.name.split("_")
    return PARAM_NAMES.get(option.name, head + "".join(w.title() for w in rest))


def describe(options=OPTIONS, indent: str = "    ") -> str:
    """A paragraph per option, ``name=default: doc.``, for a docstring."""
    return "".join(textwrap.fill(f"{o.name}={_shown(o.default)}: {o.doc}.", 96,
                                 initial_indent=indent, subsequent_indent=indent + "  ") + "\n"
                   for o in options)


def _shown(value) -> str:
    return getattr(value, "__name__", None) or repr(value)
