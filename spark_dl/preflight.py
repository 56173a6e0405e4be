"""What ``fit`` checks on the driver before any Spark job: the model factory, the model's output
against ``num_classes``, the loss and the validation labels, that what the tasks get pickles, the
label column's type, and an empty DataFrame.

The model is built once on the meta device (no memory for its weights, whatever its size) and
run on two rows of zeros of the training rows' shape; a model that the meta device cannot run
(data-dependent Python in its forward) is tried once on the CPU instead.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from .errors import ConfigError, DataError

__all__ = ["check_label_column", "check_model", "check_not_empty", "check_picklable"]

_CLASSIFY = ("cross_entropy", "nll")


def _last_frame(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    return f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""


class _Raised(Exception):
    """The factory or the forward raised (on the meta device, maybe only there)."""

    def __init__(self, error: Exception | None = None):
        super().__init__(str(error))
        self.error = error                        # the ConfigError to raise, if not the forward


# a model of at most these parameter bytes is probed on the CPU: at once, where the meta
# device's first BatchNorm or embedding imports torch._dynamo (seconds, once a process)
CPU_PROBE_BYTES = 64 << 20


def _build(model_fn: Callable[[], nn.Module], device: str) -> nn.Module:
    try:
        with torch.device(device), torch.random.fork_rng(devices=[]):   # (the caller's
            net = model_fn()                                            # draws unchanged)
    except Exception as e:
        raise _Raised(ConfigError(
            f"the model factory raised {type(e).__name__}: {e}{_last_frame(e)}; fit calls it "
            f"with no arguments in every task and expects an nn.Module")) from e
    if not isinstance(net, nn.Module):
        raise ConfigError(f"the model factory returned {type(net).__name__}, not a "
                          f"torch.nn.Module: pass a function that builds the network, e.g. "
                          f"model=lambda: FCNet((784, 100, 10)), or a model name ('fc', 'cnn')")
    return net


def _forward(net: nn.Module, rows: tuple, dtype: torch.dtype, device: str, ids: bool = False):
    net = net.to(dtype=dtype).eval()
    try:
        with torch.no_grad():
            return net(torch.zeros((2, *rows), dtype=torch.int64 if ids else dtype,
                                   device=device))
    except Exception as e:
        raise _Raised() from e


def check_model(model_fn: Callable[[], nn.Module], *, rows: tuple | None, dtype: str,
                num_classes: int | None, loss: str, validation=None, ids: bool = False) -> dict:
    """Build the model on the meta device (a small one on the CPU) and, when the shape of a
    row is known (``rows``), run it (on int64 rows when the feature column holds integers,
    ``ids``): the factory must give an nn.Module that takes such rows, and a classifier's
    outputs must match ``num_classes`` and the validation labels. Returns the model's
    signature (parameter names and shapes, outputs per row) for the run directory."""
    tdtype = torch.float64 if dtype == "float64" else torch.float32
    try:
        net, out = _probe(model_fn, rows, tdtype, "meta", ids)
    except _Raised:                               # the meta device may not run it: the CPU
        try:
            net, out = _probe(model_fn, rows, tdtype, "cpu", ids)
        except _Raised as e:
            cause = e.__cause__
            if "cuda" in str(cause).lower():      # a GPU-only model: checked where it runs
                return {"parameters": None}
            if e.error is not None:               # the factory's own error
                raise e.error from cause
            if rows is None:                      # rows of a guessed length: the tasks know
                return {"parameters": None}
            if ids:
                raise ConfigError(
                    f"the model cannot take int64 rows of shape {tuple(rows)}: "
                    f"{type(cause).__name__}: {cause}{_last_frame(cause)}; the feature column "
                    f"holds integers, which reach the model as int64 (token ids, for a model "
                    f"whose first layer is an nn.Embedding): cast the column to array<float> "
                    f"for numeric features, or give shape= the shape the model takes"
                ) from cause
            raise ConfigError(
                f"the model cannot take rows of shape {tuple(rows)}: {type(cause).__name__}: "
                f"{cause}{_last_frame(cause)}; give shape= the shape the model's first layer "
                f"takes (e.g. shape=(1, 28, 28) for the CNN), or a model for these rows"
            ) from cause
    signature = {"parameters": _shapes(net)}
    if out is None or loss not in _CLASSIFY:
        return signature
    if not isinstance(out, torch.Tensor) or out.dim() < 2:
        raise ConfigError(f"loss {loss!r} needs the model to output (batch, classes) scores, "
                          f"but it gives {_describe(out)} for a batch of 2 rows")
    classes = int(out.shape[1])
    signature["outputs"] = classes
    if num_classes is not None and classes != num_classes:
        raise ConfigError(f"num_classes={num_classes} but the model outputs {classes} scores "
                          f"per row: build it with {num_classes} outputs (its last layer), or "
                          f"give num_classes={classes} if there are {classes} classes")
    if validation is not None and len(validation[1]):
        vy = np.asarray(validation[1])
        low, high = int(vy.min()), int(vy.max())
        if low < 0 or high >= classes:
            raise DataError(f"validation labels go from {low} to {high}, but the model outputs "
                            f"{classes} scores per row ({loss} needs labels in 0..{classes - 1})"
                            f": build the model with {high + 1} outputs, or fix the labels")
    return signature


def _probe(model_fn, rows: tuple | None, dtype: torch.dtype, device: str, ids: bool = False):
    """(model, its output for 2 rows of zeros or None); flat rows of unknown length (rows
    None) are guessed from a first nn.Linear layer."""
    net = _build(model_fn, device)
    if device == "meta" and sum(p.numel() * p.element_size()
                                for p in net.parameters()) <= CPU_PROBE_BYTES:
        net, device = _build(model_fn, "cpu"), "cpu"
    width = _first_linear(net) if rows is None else None
    if width is not None:
        rows = (width,)
    return net, None if rows is None else _forward(net, rows, dtype, device, ids)


def _shapes(net: nn.Module) -> dict:
    return {k: list(v.shape) for k, v in net.state_dict().items()}


def _first_linear(net: nn.Module) -> int | None:
    """in_features of the model's first layer when that is an nn.Linear, else None."""
    for m in net.modules():
        if isinstance(m, nn.Linear):
            return m.in_features
        if len(list(m.parameters(recurse=False))):
            return None                           # a first layer of another kind
    return None


def _describe(out) -> str:
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {tuple(out.shape)}"
    return f"a {type(out).__name__}"


def check_not_empty(df) -> None:
    """An empty DataFrame is refused (one row is read to know; no full pass over the data)."""
    if df.isEmpty():
        raise DataError("the DataFrame has no rows: nothing to train on. Check the filter or "
                        "the path that made it (df.count() == 0)")


def check_picklable(items, inside: str = "the function") -> None:
    """Spark ships these to every task pickled: a TypeError naming the first that cannot be
    (``items``: (what it is, the object) pairs), here on the driver rather than Spark's
    PicklingError from deep in the job."""
    from pyspark import cloudpickle
    for what, obj in items:
        try:
            cloudpickle.dumps(obj)
        except Exception as e:
            raise TypeError(
                f"{what} cannot be pickled, and Spark ships it pickled to every task "
                f"({type(e).__name__}: {str(e)[:300]}): create locks, sockets, open files, "
                f"SparkSessions and DataFrames inside {inside}, or pass what they hold "
                f"(paths, numbers, arrays) instead") from None


def named(obj) -> str:
    """A function's or object's name for messages."""
    return getattr(obj, "__qualname__", None) or type(obj).__name__


def check_label_column(df, label: str | None, param: str = "label") -> None:
    """A label column of strings is refused with the StringIndexer line that numbers it
    (``param``: the argument that names the label column, for the hint)."""
    from pyspark.sql.types import StringType

    from .data.bridge import string_labels
    if label and isinstance(df.schema[label].dataType, StringType):
        raise string_labels(label, param)
