"""Job configuration: frozen dataclasses loaded from TOML files in ``conf/jobs/``.

Every section of a TOML file maps to one dataclass; unknown sections or keys are an error that
names the key, the file and the keys that are allowed, so a typo never silently falls back to a
default. The [train] keys that are fit's options are made from their definitions
(spark_dl.options).
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from . import options
from .errors import ConfigError

__all__ = ["DataConfig", "DemoConfig", "TrainConfig", "from_mapping", "load_toml"]

T = TypeVar("T")


def _check(cond: bool, key: str, value: Any, fix: str) -> None:
    if not cond:
        raise ConfigError(f"'{key}' {fix}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the MNIST digits come from and how the extended set is made."""

    images: str = "data/mnist/t10k-images-idx3-ubyte.gz"
    labels: str = "data/mnist/t10k-labels-idx1-ubyte.gz"
    n_train_source: int = 8000      # the first n digits are the training sources
    n_test: int = 2000              # the last n digits are the test set
    extended_samples: int = 24000   # distorted digits generated on the executors
    partitions: int = 4
    shards_dir: str = "work/extended-mnist"
    seed: int = 0

    def __post_init__(self):
        _check(self.n_train_source >= 1, "data.n_train_source", self.n_train_source, "must be >= 1")
        _check(self.n_test >= 1, "data.n_test", self.n_test, "must be >= 1")
        _check(self.extended_samples >= 0, "data.extended_samples", self.extended_samples,
               "must be >= 0")
        _check(self.partitions >= 1, "data.partitions", self.partitions, "must be >= 1")


# the keys of [train] that are fit's options: from their definitions (spark_dl.options)
_FitKeys = dataclasses.make_dataclass(
    "_FitKeys", [(o.name, o.toml_type(), dataclasses.field(default=options.default(o, "toml"),
                                                            metadata={"doc": o.doc}))
                 for o in options.on("toml")], frozen=True, namespace={"__module__": __name__})

# what the recipes hand fit by name (the rest of fit's keys: TrainConfig.fit_options)
_BY_NAME = ("strategy", "replicas", "epochs", "batch_size", "optimizer", "lr", "momentum", "seed")


@dataclasses.dataclass(frozen=True)
class TrainConfig(_FitKeys):
    """The model and the optimisation of one fit: a job file's [train] table.

    Its keys: the model's (below) and those of fit's options that spark_dl.options marks
    "toml", each checked as fit checks it, with fit's meaning and default (but
    options.TOML_DEFAULTS'). ``strategy`` is also "single" (one process, no Spark stage), or a
    table [train.strategy] with ``name = ...`` and the strategy's options.
    """

    MODELS: ClassVar[tuple] = ("cnn", "cnn_bn", "fc")
    model: str = "cnn"              # "cnn" (thesis CNN), "cnn_bn" (with BatchNorm) or "fc"
    strategy_options: dict = dataclasses.field(default_factory=dict)  # from [train.strategy]
    fc_hidden: tuple = (480, 160)   # the FC net's hidden widths (the thesis: 480, 160)

    def __post_init__(self):
        object.__setattr__(self, "fc_hidden", tuple(self.fc_hidden))
        _check(len(self.fc_hidden) >= 1 and all(isinstance(w, int) and w >= 1
                                                 for w in self.fc_hidden),
               "train.fc_hidden", list(self.fc_hidden), "must list positive widths")
        _check(self.model in self.MODELS, "train.model", self.model,
               f"must be one of {', '.join(map(repr, self.MODELS))}")
        _strategy_spec(self, "train.strategy")
        for option in options.on("toml"):
            if option.name != "strategy":
                option.check(options.to_fit(option, getattr(self, option.name)), "train")
        _check(not self.nesterov or (self.optimizer == "sgd" and self.momentum > 0),
               "train.nesterov", self.nesterov, f"needs optimizer = 'sgd' and momentum > 0 "
               f"(optimizer = {self.optimizer!r}, momentum = {self.momentum!r})")
        from .strategies import STRATEGIES
        takes = ["single", *(n for n, cls in STRATEGIES.items() if cls.nesterov)]
        _check(not self.nesterov or self.strategy in takes, "train.nesterov", self.nesterov,
               f"runs with strategy {', '.join(map(repr, takes[:-1]))} or {takes[-1]!r}, not "
               f"{self.strategy!r} (whose staleness rule places the momentum)")
        _check(self.resources is None or self.strategy != "single", "train.resources",
               self.resources, "is the Spark training stage's, and strategy 'single' runs "
               "none: drop it, or pick a Spark strategy")
        from .optim.schedule import check_lr_scaling
        try:
            check_lr_scaling(self.lr_scaling, self.warmup_epochs, self.epochs)
        except ConfigError as e:
            raise ConfigError(f"train.{e}") from None

    @property
    def fit_options(self) -> dict:
        """fit()'s keywords from this table that the recipes do not pass by name (lr_scaling,
        warmup_epochs, grad_clip, nesterov)."""
        return {o.name: options.to_fit(o, getattr(self, o.name)) for o in options.on("toml")
                if o.name not in _BY_NAME}

    @property
    def partitions(self) -> int | str:
        """Downpour's model partitions F (1 for the other strategies)."""
        return self.strategy_options.get("partitions", 1)

    def make_strategy(self):
        """The spark_dl.strategies object of ``strategy`` and its options."""
        from .strategies import make_strategy
        return make_strategy(self.strategy, **self.strategy_options)


def _strategy_spec(cfg, key: str) -> None:
    """Normalise ``cfg.strategy`` (a name, or a table with ``name`` and options) into the name
    and ``cfg.strategy_options``, and make the strategy once so that a bad option fails here,
    naming the key."""
    from .strategies import STRATEGIES, make_strategy
    spec = cfg.strategy
    strategy_options = dict(cfg.strategy_options)
    if isinstance(spec, Mapping):
        strategy_options = {**{k: v for k, v in spec.items() if k != "name"},
                            **strategy_options}
        spec = spec.get("name")
        _check(spec is not None, key, dict(cfg.strategy), f"is a table that needs name = one "
               f"of {', '.join(map(repr, STRATEGIES))}")
    object.__setattr__(cfg, "strategy", spec)
    object.__setattr__(cfg, "strategy_options", strategy_options)
    _check(spec in ("single", *STRATEGIES), key, spec,
           f"must be one of 'single', {', '.join(map(repr, STRATEGIES))}")
    if spec == "single":
        _check(not strategy_options, key, strategy_options, "'single' takes no options")
        return
    try:
        make_strategy(spec, **strategy_options)
    except ConfigError as e:
        raise ConfigError(f"'{key}': {e}") from None


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """``conf/jobs/demo.toml``: extended-MNIST shards on Spark, then one training pass."""

    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()


def from_mapping(cls: type[T], values: Mapping[str, Any], where: str = "<dict>",
                 prefix: str = "") -> T:
    """Build dataclass ``cls`` from a (nested) mapping, rejecting unknown keys by name."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(
                f"unknown key '{dotted}' in {where}; allowed keys here: {', '.join(fields)}")
        ftype = fields[key].type
        sub = _dataclass_type(cls, key)
        if sub is not None:
            if not isinstance(value, Mapping):
                raise ConfigError(f"'{dotted}' in {where} must be a table [{dotted}], "
                                  f"got {value!r}")
            value = from_mapping(sub, value, where, prefix=f"{dotted}.")
        else:
            value = _coerce(value, ftype, dotted, where)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{e} (in {where})") from None


def _dataclass_type(cls, name):
    default = next(f for f in dataclasses.fields(cls) if f.name == name).default
    return type(default) if dataclasses.is_dataclass(default) else None


_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _coerce(value, ftype, key, where):
    want = _TYPES.get(ftype if isinstance(ftype, str) else getattr(ftype, "__name__", ""))
    if want is None:
        return value
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise ConfigError(f"'{key}' in {where} must be of type {want.__name__}, got {value!r}")
    return value


def load_toml(cls: type[T], path: str | Path, overrides: Mapping[str, Any] | None = None) -> T:
    """Load ``cls`` from a TOML file; ``overrides`` maps dotted keys ("train.lr") to values."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass an existing TOML file "
                          f"(see conf/jobs/)")
    try:
        values = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from e
    for dotted, value in (overrides or {}).items():
        *tables, leaf = dotted.split(".")
        node = values
        for t in tables:
            if isinstance(node.get(t), str):          # train.strategy = "x" -> a table
                node[t] = {"name": node[t]}
            node = node.setdefault(t, {})
        node[leaf] = value
    return from_mapping(cls, values, where=str(path))
