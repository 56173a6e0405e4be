"""``spark_dl.fit``: train a torch model on a DataFrame's partitions with a distributed strategy.

    from spark_dl import fit, Downpour
    result = fit(df, "cnn", strategy="allreduce", shape=(1, 28, 28), num_classes=10,
                 optimizer="sgd", lr=0.05, momentum=0.9, epochs=3, batch_size=64)
    result = fit(df, "cnn", strategy=Downpour(n_push=4, mode="sync"), shape=(1, 28, 28), ...)
    result.model, result.history, result.run_dir

The DataFrame holds a feature column (array<float> or fixed-size list, reshaped to ``shape``)
and a label column; each partition is one replica's shard (``replicas`` repartitions). Rows
never reach the driver: each task reads its partition through the Arrow bridge. What the
replicas share, and how, is the strategy's (spark_dl.strategies); this module holds what every
strategy shares.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from torch import nn

from .compat import default_parallelism, gpu_request_error, master, num_partitions, task_slots
from .errors import ConfigError, DataError, ResourceError
from .losses import loss_function
from .optim.clip import check_grad_clip
from .optim.factory import OPTIMIZERS
from .optim.schedule import check_lr_scaling, resolve_scaling
from .preflight import check_model, check_not_empty
from .runtime.stage import StageConfig
from .strategies import STRATEGIES, Strategy, make_strategy, option_owner
from .strategies.base import FitResult, Job
from .tracking import Tracker

__all__ = ["STRATEGIES", "FitResult", "fit"]


def _model_factory(model: str | Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    if isinstance(model, str):
        from .models import build_model
        build_model(model)                      # unknown names fail here, on the driver
        return lambda: build_model(model)
    if not callable(model):
        raise TypeError(f"model must be a model name ('fc', 'cnn') or a function returning an "
                        f"nn.Module, got {type(model).__name__}")
    return model


def _check(name: str, ok: bool, value, must: str) -> None:
    if not ok:
        raise ConfigError(f"{name} must be {must}, got {value!r}")


def _validation(validation, shape, dtype: str):
    """The validation arrays, checked and shaped as the training rows."""
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
    return vx.astype(np.float64 if dtype == "float64" else np.float32), vy


def fit(df, model: str | Callable[[], nn.Module], *, strategy: str | Strategy = "allreduce",
        features: str = "features", label: str = "label", shape=(), label_shape=(),
        num_classes: int | None = None, loss: str | Callable = "cross_entropy",
        optimizer: str = "sgd", lr: float = 0.01, lr_decay: float = 1.0,
        lr_scaling: str | None = "auto", warmup_epochs: float | str = "auto",
        grad_clip: float | str | None = "auto", momentum: float = 0.0, nesterov: bool = False,
        weight_decay: float = 0.0, max_iter: int = 3,
        epochs: int = 1, batch_size: int = 64, replicas: int | None = None,
        shuffle: bool = True, seed: int = 0, dtype: str = "float32", device: str = "auto",
        threads: int = 0, validation: tuple | None = None, validate_every: float = 1.0,
        run_dir=None, resume: bool = True,
        progress: bool = True, log: Callable[[str], None] | None = print,
        timeout_s: float = 300.0, data: str = "auto", shuffle_buffer: int | str = "256MB",
        transform: Callable | None = None, track=None, **options) -> FitResult:
    """Train ``model`` (a name from spark_dl.models or a zero-argument factory) on ``df``.

    strategy: a strategy object (``AllReduce(...)``, ``Downpour(...)``, ``Gossip(...)``, see
      spark_dl.strategies for their options) or a name ("allreduce", "downpour", "gossip"):
      its defaults.
    optimizer, lr, momentum, weight_decay, max_iter: the replicas' optimizer (Downpour: the
      server's, see its server_optimizer); lr_decay: lr is multiplied by it after every epoch.
      ``lr`` is the rate for one replica's mini-batch of ``batch_size`` rows.
    nesterov: SGD's momentum in Nesterov's form (AllReduce and Gossip; needs momentum > 0;
      Downpour's and Boosting's staleness rules place the momentum themselves). AllReduce
      on the thesis CNN reached 98% sooner with it, at one replica and at two
      (docs/guides/fit.md, "Nesterov's momentum").
    lr_scaling, warmup_epochs: how the rate follows the global batch when an update averages
      k such mini-batches (AllReduce: replicas x accumulate; Gossip: replicas; Downpour sync:
      replicas; an asynchronous push of n mini-batches: n): "linear" (k lr, SGD), "sqrt"
      (sqrt(k) lr, Adam-like), None (lr as given), or "auto" (linear for SGD, sqrt for Adam,
      RMSprop and Adagrad, None for L-BFGS and CG), reached by a linear warmup from lr over
      ``warmup_epochs`` ("auto": growing with log2 k to a quarter of the fit, at most 2
      epochs, from k = 32 on). The
      rate of each epoch is in the history ("lr"); see spark_dl.optim.schedule.
    grad_clip: AllReduce's and Gossip's cut of the update's gradient norm: a number (its
      maximum), None (off) or "auto" (when the rate is scaled, k = replicas x accumulate > 1:
      at twice its running mean, which keeps the linear rule's large rates from diverging).
      Downpour and Boosting take ``clip`` on their server instead; see spark_dl.optim.clip.
    batch_size: per replica and step (AllReduce's ``accumulate`` micro-batches make one step).
    replicas: number of replicas (default: the DataFrame's partitions, at most the cluster's
      task slots); the data is repartitioned when it differs.
    device: "auto" (the GPU Spark assigned to the task, else the CPU), "cpu" or "cuda";
      dtype: "float32" or "float64" (exactness checks).
    data: how a task holds its partition: "memory" (read into one array; a partition larger
      than the task's memory fails with a ResourceError), "stream" (spilled once to Spark's
      local directory in its storage dtype, read back per epoch through a shuffle buffer:
      memory bounded by the buffer, whatever the partition's size) or "auto" (in memory while
      the partition stays under a quarter of the task's memory headroom, else streamed).
    shuffle_buffer: rows (int) or a size ("256MB") of a streamed shard's shuffle buffer.
    transform: ``transform(x, y) -> (x_tensor, y_tensor)`` on every mini-batch's numpy rows
      (storage dtypes: uint8 for binary pixel columns), instead of the default conversion.
    validation: (x, y) numpy arrays evaluated after every epoch (the model the strategy
      returns: by default the moving average of replica 0's weights, of the server's, or of
      the replicas' mean, its ``average``); validate_every: also
      every this fraction of an epoch (e.g. 0.25), into ``info["evals"]`` with the training
      seconds so far (validation's own time left out).
    run_dir: where config, metrics, history, plot and checkpoints go (default
      runs/<strategy>-<time>-<id>); a run_dir with a checkpoint is resumed when ``resume``.
    track: None, "tensorboard", "mlflow" or both in a list: the run's figures also go there.
    """
    if options:
        owners = {k: option_owner(k) for k in options}
        raise ConfigError("; ".join(
            f"{k} is an option of the {owner} strategy: pass strategy={owner}({k}=...)"
            if owner else f"fit() has no argument {k!r}" for k, owner in owners.items()))
    strategy = make_strategy(strategy)
    _check("optimizer", optimizer in OPTIMIZERS, optimizer, f"one of {', '.join(OPTIMIZERS)}")
    for name, value in (("epochs", epochs), ("batch_size", batch_size), ("max_iter", max_iter)):
        _check(name, isinstance(value, int) and value >= 1, value, "an integer >= 1")
    _check("lr", lr > 0, lr, "> 0")
    _check("lr_decay", 0 < lr_decay <= 1, lr_decay, "in (0, 1] (a per-epoch factor)")
    _check("momentum", 0 <= momentum < 1, momentum, "in [0, 1)")
    if nesterov not in (False, True):
        raise ConfigError(f"nesterov must be True or False, got {nesterov!r}")
    if nesterov and (optimizer != "sgd" or momentum <= 0):
        raise ConfigError(f"nesterov=True is SGD's Nesterov momentum: it needs optimizer='sgd' "
                          f"and momentum > 0, got optimizer={optimizer!r}, "
                          f"momentum={momentum!r}")
    check_lr_scaling(lr_scaling, warmup_epochs, epochs)
    check_grad_clip(grad_clip)
    fixed_clip = grad_clip not in (None, "auto", 0)           # a maximum norm
    if fixed_clip and optimizer in ("lbfgs", "cg"):
        raise ConfigError(f"grad_clip={grad_clip!r} with optimizer {optimizer!r}: its line "
                          f"search picks its own steps from the gradient, so a cut does not "
                          f"apply; use grad_clip=None, or optimizer='sgd' or 'adam'")
    _check("validate_every", isinstance(validate_every, (int, float)) and
           not isinstance(validate_every, bool) and 0 < validate_every <= 1, validate_every,
           "a fraction of an epoch in (0, 1]")
    _check("dtype", dtype in ("float32", "float64"), dtype, "'float32' or 'float64'")
    _check("device", device in ("auto", "cpu", "cuda"), device, "'auto', 'cpu' or 'cuda'")
    from .data.stream import DATA_MODES, parse_buffer
    _check("data", data in DATA_MODES, data, f"one of {', '.join(DATA_MODES)}")
    parse_buffer(shuffle_buffer)
    if transform is not None and not callable(transform):
        raise TypeError(f"transform must be a function (x, y) -> (tensor, tensor), got "
                        f"{type(transform).__name__}")
    loss_name = loss if isinstance(loss, str) else "custom"
    loss_fn = loss_function(loss) if isinstance(loss, str) else loss
    if not callable(loss_fn):
        raise TypeError(f"loss must be a name or a callable, got {type(loss).__name__}")
    for col in (features, label):
        if col and col not in df.columns:
            raise DataError(f"column {col!r} not in the DataFrame (columns: {df.columns}); "
                            f"pass features=/label= with the right names")
    if replicas is not None:
        _check("replicas", isinstance(replicas, int) and replicas >= 1, replicas,
               "an integer >= 1")
    spark = df.sparkSession
    why = gpu_request_error(master(spark),
                            spark.conf.get("spark.task.resource.gpu.amount", None), device)
    if why:
        raise ConfigError(why)
    validation = _validation(validation, shape, dtype)
    model_fn = _model_factory(model)
    rows = tuple(shape) if len(shape) else validation[0].shape[1:] if validation else None
    signature = check_model(model_fn, rows=None if transform else rows, dtype=dtype,
                            num_classes=num_classes, loss=loss_name, validation=validation)
    stage = StageConfig(
        features=features, label=label, shape=tuple(shape), label_shape=tuple(label_shape),
        num_classes=num_classes, loss=loss_name, epochs=epochs, batch_size=batch_size,
        shuffle=shuffle, seed=seed, dtype=dtype, device=device, threads=threads,
        timeout_s=timeout_s, data=data, shuffle_buffer=shuffle_buffer, transform=transform,
        resume=resume, validate_every=float(validate_every))
    job = Job(df=df, model=model, model_fn=model_fn, loss_fn=loss_fn, signature=signature,
              loss_name=loss_name, stage={f: getattr(stage, f) for f in
                                          StageConfig.__dataclass_fields__},
              train=dict(optimizer=optimizer, lr=float(lr), lr_decay=float(lr_decay),
                         momentum=float(momentum), nesterov=bool(nesterov),
                         weight_decay=float(weight_decay),
                         max_iter=max_iter,
                         lr_scaling=resolve_scaling(lr_scaling, optimizer),
                         warmup_epochs=warmup_epochs, grad_clip=grad_clip),
              replicas=replicas, validation=validation,
              run_dir=run_dir, progress=progress, log=log, tracker=Tracker(track),
              slots=task_slots(spark), partitions=num_partitions(df))
    job.plan["lr_scaling_auto"] = lr_scaling == "auto"      # a strategy may refine the rule
    if fixed_clip and strategy.name not in ("allreduce", "gossip"):
        raise ConfigError(f"grad_clip={grad_clip!r} cuts the gradient a replica steps with "
                          f"(AllReduce, Gossip); {strategy.name}'s server steps instead: pass "
                          f"{type(strategy).__name__}(clip=...) for its server's cut (in "
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
        raise ResourceError(
            f"replicas={job.replicas} but the cluster runs {job.slots} task(s) at once (default "
            f"parallelism {default_parallelism(spark)} / spark.task.cpus); the "
            f"replicas train together: use replicas <= {job.slots} or add executors/cores")
    check_not_empty(df)
    return strategy.run(job)
