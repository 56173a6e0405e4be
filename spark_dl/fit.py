"""``spark_dl.fit``: train a torch model on a DataFrame's partitions with a distributed strategy.

    from spark_dl import fit, Downpour
    result = fit(df, "cnn", strategy="allreduce", shape=(1, 28, 28), num_classes=10,
                 optimizer="sgd", lr=0.05, momentum=0.9, epochs=3, batch_size=64)
    result = fit(df, "cnn", strategy=Downpour(n_push=4, mode="sync"), shape=(1, 28, 28), ...)
    result.model, result.history, result.run_dir

The DataFrame holds a feature column (array<float>, fixed-size list or Spark ML vector, dense or
sparse, reshaped to ``shape``; integers, such as token ids, reach the model as int64, floats in
``dtype``) and a label column (class ids for a classifier: integers, or doubles holding whole
numbers as StringIndexer makes them); each partition is one replica's shard (``replicas``
repartitions). Rows never reach the driver: each task reads its partition through the Arrow
bridge. What the replicas share, and how, is the strategy's (spark_dl.strategies); this module
holds what every strategy shares. Its options are declared in spark_dl.options.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from torch import nn

from .compat import default_parallelism, gpu_request_error, master, num_partitions, task_slots
from .errors import ConfigError, DataError, ResourceError
from .losses import loss_function
from .optim.schedule import check_lr_scaling, resolve_scaling
from .options import OPTIONS, describe
from .preflight import check_label_column, check_model, check_not_empty, check_picklable, named
from .resources import profile_slots, stage_profile, task_amounts
from .runtime.stage import StageConfig
from .strategies import STRATEGIES, Strategy, make_strategy, option_owner
from .strategies.base import FitResult, Job
from .tracking import EXAMPLE_ROWS, Tracker

__all__ = ["STRATEGIES", "FitResult", "fit"]


def _misplaced(options: dict) -> ConfigError:
    """The error for keywords fit does not take: a strategy's option names its strategy."""
    owners = {k: option_owner(k) for k in options}
    return ConfigError("; ".join(
        f"{k} is an option of the {owner} strategy: pass strategy={owner}({k}=...)"
        if owner else f"fit() has no argument {k!r}" for k, owner in owners.items()))


def _fixed_clip(grad_clip) -> bool:
    """Whether ``grad_clip`` is a maximum norm (not None, "auto" or 0: off)."""
    return grad_clip not in (None, "auto", 0)


def _check_together(args: dict) -> None:
    """ConfigErrors for options that do not go together (each alone is checked already)."""
    optimizer, momentum, grad_clip = args["optimizer"], args["momentum"], args["grad_clip"]
    if args["nesterov"] and (optimizer != "sgd" or momentum <= 0):
        raise ConfigError(f"nesterov=True is SGD's Nesterov momentum: it needs optimizer='sgd' "
                          f"and momentum > 0, got optimizer={optimizer!r}, "
                          f"momentum={momentum!r}")
    check_lr_scaling(args["lr_scaling"], args["warmup_epochs"], args["epochs"])
    if _fixed_clip(grad_clip) and optimizer in ("lbfgs", "cg"):
        raise ConfigError(f"grad_clip={grad_clip!r} with optimizer {optimizer!r}: its line "
                          f"search picks its own steps from the gradient, so a cut does not "
                          f"apply; use grad_clip=None, or optimizer='sgd' or 'adam'")


def _loss(loss) -> tuple[str, Callable]:
    """The loss's name (for the run's config; "custom" for a callable) and its function."""
    if isinstance(loss, str):
        return loss, loss_function(loss)
    if not callable(loss):
        raise TypeError(f"loss must be a name or a callable, got {type(loss).__name__}")
    return "custom", loss


def _handed(args: dict) -> tuple[dict, dict]:
    """What fit hands the strategy for its tasks: StageConfig's fields (the data, the loop, the
    task's resources) and the replicas' optimizer (LocalStepConfig's own fields)."""
    given = {o.name: o.cast(args[o.name]) for o in OPTIONS}
    stage = StageConfig(**{o.name: given[o.name] for o in OPTIONS if o.to == "stage"})
    train = {o.name: given[o.name] for o in OPTIONS if o.to == "train"}
    train["lr_scaling"] = resolve_scaling(args["lr_scaling"], args["optimizer"])
    return {f: getattr(stage, f) for f in StageConfig.__dataclass_fields__}, train


def _model_factory(model: str | Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    if isinstance(model, str):
        from .models import build_model
        build_model(model)                      # unknown names fail here, on the driver
        return lambda: build_model(model)
    if not callable(model):
        from .models import MODELS
        raise TypeError(f"model must be a model name ({', '.join(MODELS)}) or a function "
                        f"returning an nn.Module, got {type(model).__name__}")
    return model


def _integer_features(df, features: str) -> bool:
    """Whether ``df``'s feature column holds integers (array<int>, array<bigint>, ... or an
    integer scalar): they reach the model as int64 (token ids, exact), not in the fit's dtype;
    binary pixel bytes and floats do not."""
    from pyspark.sql.types import ArrayType, IntegralType
    if not features or features not in df.columns:
        return False
    t = df.schema[features].dataType
    return isinstance(t.elementType if isinstance(t, ArrayType) else t, IntegralType)


def _validation(validation, shape, dtype: str, ids: bool = False, class_ids: bool = False):
    """The validation arrays, checked and shaped as the training rows (integer features as
    int64 when the training rows hold integers, ``ids``; with ``class_ids``, a classifier's,
    labels that are floats holding whole numbers become int64, as the training labels do)."""
    if validation is None:
        return None
    if not isinstance(validation, (tuple, list)) or len(validation) != 2:
        raise DataError(f"validation must be a pair (x, y) of arrays, got "
                        f"{type(validation).__name__}")
    vx, vy = (np.asarray(a) for a in validation)
    if len(vx) != len(vy):
        raise DataError(f"validation x has {len(vx)} rows but y has {len(vy)}")
    if vx.dtype.kind not in "fiub" or vy.dtype.kind not in "fiub":
        raise DataError(f"validation arrays must be numeric, got x of {vx.dtype} and y of "
                        f"{vy.dtype}")
    if vx.dtype.kind == "f" and not np.isfinite(vx).all():
        raise DataError("validation x holds NaN or inf; clean it before training")
    if len(shape) and len(vx) and vx[0].size != int(np.prod(shape)):
        raise DataError(f"validation x has rows of shape {vx.shape[1:]} ({vx[0].size} values) "
                        f"but the training rows have shape={tuple(shape)} "
                        f"({int(np.prod(shape))} values): give validation rows like the "
                        f"training rows")
    vx = vx.reshape(len(vx), *shape) if len(shape) else vx
    if class_ids and vy.dtype.kind == "f":
        off = np.flatnonzero((vy != np.floor(vy)).reshape(len(vy), -1).any(axis=1))
        if len(off):
            r = int(off[0])
            raise DataError(f"validation label {float(np.ravel(vy[r])[0])!r} (row {r}) is not "
                            f"a class id: class ids are whole numbers (0, 1, 2 ...)")
        vy = vy.astype(np.int64)
    if ids:
        if vx.dtype.kind not in "iu":
            raise DataError(f"validation x holds {vx.dtype} values but the feature column holds "
                            f"integers (token ids, which reach the model as int64): give "
                            f"validation rows of integers, like the training rows")
        return vx.astype(np.int64), vy
    return vx.astype(np.float64 if dtype == "float64" else np.float32), vy


def _rows(value, dtype) -> np.ndarray:
    """One feature value of a collected Row as numpy: an ML vector's values, bytes as the
    uint8 pixels the tasks read, or the array."""
    if hasattr(value, "toArray"):
        return value.toArray()
    if isinstance(value, (bytes, bytearray)):
        return np.frombuffer(value, np.uint8)
    return np.asarray(value, dtype)


def _example(df, args: dict, validation, tracker: Tracker):
    """A few training rows as the model takes them (numpy, in fit's dtype), for the
    signature of the model a tracker logs (None when none does): the validation rows, else
    the DataFrame's first rows, read in place of the empty-DataFrame check (one small job,
    never the whole DataFrame). Raises the DataError of an empty DataFrame."""
    if not tracker.wants_model:
        check_not_empty(df)
        return None
    dtype = np.float64 if args["dtype"] == "float64" else np.float32
    shape, transform = tuple(args["shape"]), args["transform"]
    if validation is not None and len(validation[0]):
        check_not_empty(df)
        x, y = validation[0][:EXAMPLE_ROWS], validation[1][:EXAMPLE_ROWS]
    else:
        cols = [args["features"]] + ([args["label"]] if args["label"] else [])
        rows = df.select(*cols).head(EXAMPLE_ROWS)
        if not rows:
            check_not_empty(df)             # its error (an empty DataFrame)
        try:
            x = np.stack([_rows(r[0], dtype) for r in rows])
        except (TypeError, ValueError):     # ragged or null rows: the tasks' DataError says so
            return None
        y = np.asarray([r[1] for r in rows]) if len(cols) > 1 else None
        x = x.reshape(len(x), *shape) if shape else x
    if transform is not None:               # the model takes what transform makes, as made
        x = transform(x, y)[0]
        return np.ascontiguousarray(x.numpy() if hasattr(x, "numpy") else x)
    if x.dtype == np.uint8:                 # as the tasks convert bytes: to [0, 1]
        x = x / 255.0
    return np.ascontiguousarray(x, dtype=dtype)


def fit(df, model: str | Callable[[], nn.Module], *, strategy: str | Strategy = "allreduce",
        features: str = "features", label: str = "label", shape=(), label_shape=(),
        num_classes: int | None = None, loss: str | Callable = "cross_entropy",
        optimizer: str = "sgd", lr: float = 0.01, lr_decay: float = 1.0,
        lr_scaling: str | None = "auto", warmup_epochs: float | str = "auto",
        grad_clip: float | str | None = "auto", momentum: float = 0.0, nesterov: bool = False,
        weight_decay: float = 0.0, max_iter: int = 3,
        epochs: int = 1, batch_size: int = 64, replicas: int | None = None,
        shuffle: bool = True, seed: int = 0, dtype: str = "float32", device: str = "auto",
        threads: int = 0, resources: dict | None = None, validation: tuple | None = None,
        validate_every: float = 1.0, run_dir=None, resume: bool = True,
        progress: bool = True, log: Callable[[str], None] | None = print,
        timeout_s: float = 300.0, data: str = "auto", shuffle_buffer: int | str = "256MB",
        transform: Callable | None = None, track=None, **options) -> FitResult:
    """Train ``model`` (a name from spark_dl.models or a zero-argument factory) on the
    partitions of ``df``, one replica each, sharing what they learn as ``strategy`` says.

    Returns a FitResult: the model, one history row per epoch, the strategy's info and the run
    directory. A strategy's own options go on its object (``Downpour(n_push=4)``); one given
    here is a ConfigError that says where it belongs. docs/guides/fit.md explains the choices
    (the learning-rate rules, Nesterov's momentum, streamed data) and links the measurements
    behind them. Each option is declared once, in spark_dl.options (``OPTIONS``), from which
    ``help(spark_dl.fit)`` lists them, with their defaults:
    """
    started_at = time.time()
    args = dict(locals())
    args.pop("started_at")
    if options:
        raise _misplaced(options)
    strategy = make_strategy(strategy)
    for option in OPTIONS:
        option.check(args[option.name])
    _check_together(args)
    loss_name, loss_fn = _loss(loss)
    for col in (features, label):
        if col and col not in df.columns:
            raise DataError(f"column {col!r} not in the DataFrame (columns: {df.columns}); "
                            f"pass features=/label= with the right names")
    check_label_column(df, label)
    spark = df.sparkSession
    profile = stage_profile(spark, resources)
    task_gpus = spark.conf.get("spark.task.resource.gpu.amount", None) if resources is None \
        else str(task_amounts(spark, resources)[1])
    why = gpu_request_error(master(spark), task_gpus, device)
    if why:
        raise ConfigError(why)
    ids = transform is None and _integer_features(df, features)
    validation = _validation(validation, shape, dtype, ids,
                             num_classes is not None or
                             (loss_name == "cross_entropy" and not len(label_shape)))
    model_fn = _model_factory(model)
    check_picklable(((f"the model factory {named(model_fn)}", model_fn),
                     *(((f"the loss {named(loss_fn)}", loss_fn),) if loss_name == "custom"
                       else ()),
                     *(((f"the transform {named(transform)}", transform),) if transform
                       else ())), inside="the factory or function")
    rows = tuple(shape) if len(shape) else validation[0].shape[1:] if validation else None
    signature = check_model(model_fn, rows=None if transform else rows, dtype=dtype,
                            num_classes=num_classes, loss=loss_name, validation=validation,
                            ids=ids)
    stage, train = _handed({**args, "loss": loss_name})
    slots = task_slots(spark) if profile is None else profile_slots(spark, profile, resources)
    job = Job(df=df, model=model, model_fn=model_fn, loss_fn=loss_fn, signature=signature,
              loss_name=loss_name, stage=stage, train=train, replicas=replicas,
              validation=validation, run_dir=run_dir, progress=progress, log=log,
              tracker=Tracker(track), slots=slots, partitions=num_partitions(df),
              profile=profile, started_at=started_at)
    job.plan["lr_scaling_auto"] = lr_scaling == "auto"      # a strategy may refine the rule
    if _fixed_clip(grad_clip) and strategy.name not in ("allreduce", "gossip", "fsdp"):
        raise ConfigError(f"grad_clip={grad_clip!r} cuts the gradient a replica steps with "
                          f"(AllReduce, Gossip, FSDP); {strategy.name}'s server steps instead: "
                          f"pass {type(strategy).__name__}(clip=...) for its server's cut (in "
                          f"asynchronous mode; a synchronous server does not cut)")
    strategy.check_job(job)
    strategy.tasks(job)
    if strategy.barrier(job) and \
            spark.conf.get("spark.dynamicAllocation.enabled", "false") == "true":
        raise ConfigError(f"this fit runs a barrier stage ({strategy.name}), which Spark does "
                          f"not run with dynamic allocation: set "
                          f"spark.dynamicAllocation.enabled=false for this application, or use "
                          f"strategy='downpour' with partitions=1")
    if job.replicas > job.slots:
        counted = f"default parallelism {default_parallelism(spark)} / spark.task.cpus" \
            if profile is None else f"tasks of resources={resources!r} on its executors"
        raise ResourceError(
            f"replicas={job.replicas} but the cluster runs {job.slots} task(s) at once "
            f"({counted}); the replicas train together: use replicas <= {job.slots} or add "
            f"executors/cores")
    job.example = _example(df, args, validation, job.tracker)
    return strategy.run(job)


if fit.__doc__:                         # the options' list, from their definitions
    fit.__doc__ = f"{fit.__doc__.rstrip()}\n\n{describe(OPTIONS)}"
