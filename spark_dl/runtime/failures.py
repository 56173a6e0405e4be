"""Errors raised inside the tasks, delivered to the caller in seconds.

Spark would hand the driver a ``Py4JJavaError`` around the Python traceback, after retrying the
task or the barrier stage (each retry waiting on the peers' timeouts). Instead, a task that
raises sends the driver one authenticated message first -- the exception's type, message, a
traceback summary, the task and the epoch/step it was in -- then raises; the driver cancels the
fit's Spark job at once (its tag: the other tasks of a barrier stage stop, nothing is retried)
and raises a spark_dl error that carries all of it.

Transient faults are not reported: a peer's death seen from torch.distributed, a lost
connection, a timeout. Spark retries those as before (the chaos tests), resuming from the
checkpoint.
"""

from __future__ import annotations

import builtins
import threading
import traceback

from ..compat import is_connect
from ..errors import ConfigError, DataError, ResourceError, SparkDLError, TaskError

__all__ = ["WHERE", "TaskError", "TaskErrors", "at", "fix_for", "is_transient", "report",
           "task_error"]

# where this task is (set by the training loops): a failing task says which step failed
WHERE: dict = {"epoch": None, "step": None}


def at(epoch: int | None, step: int | None) -> None:
    """The task is at ``epoch`` / ``step`` (0-based), for the error report."""
    WHERE["epoch"], WHERE["step"] = epoch, step


def is_transient(e: BaseException) -> bool:
    """A fault Spark should retry (a peer or a connection lost), not the user's error. What
    would fail again the same way (NCCL's invalid usage such as two ranks on one GPU, CUDA
    out of memory at the same batch) is not transient, whatever class torch gives it."""
    try:
        from torch.distributed import DistError
    except ImportError:                          # torch built without distributed
        DistError = ()
    if isinstance(e, SparkDLError) or fix_for(e) is not None:
        return False
    if isinstance(e, (DistError, ConnectionError, TimeoutError, EOFError, KeyboardInterrupt,
                      SystemExit)):
        return True
    # gloo raises a plain RuntimeError when a peer dies ("[.../gloo/transport/tcp/pair.cc:537]
    # Read error ...: Connection reset by peer")
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in _TRANSPORT_FAULTS)


_TRANSPORT_FAULTS = ("gloo/transport", "Connection reset by peer", "Connection closed by peer",
                     "Connection refused", "Broken pipe", "NCCL communicator was aborted",
                     "ProcessGroupNCCL", "Socket Timeout", "timed out")


def fix_for(e: BaseException) -> str | None:
    """What to change when ``e`` is a fault that a retry would meet again, or None."""
    text = str(e)
    if "Duplicate GPU detected" in text:
        return ("several ranks of one NCCL group are on the same GPU (more tasks than GPUs, "
                "or a fractional spark.task.resource.gpu.amount): give every task its own GPU "
                "(spark.task.resource.gpu.amount=1), or let spark_dl choose the backend: its "
                "fits and spark_dl.run's group use gloo for replicas that share a GPU")
    if "invalid usage" in text and "NCCL" in text:
        return ("NCCL rejected how it was called (its message says how); a retry would fail "
                "the same way: fix the call or use the process group spark_dl set up")
    if "Expected all tensors to be on the same device" in text or (
            "Input type" in text and "weight type" in text and "cuda" in text.lower()):
        return ("the model and its input are on different devices: fit's batches and "
                "spark_dl.run's ctx.batches() are on the task's device (ctx.device: the GPU "
                "Spark assigned, with device='auto' or 'cuda'); build the model there "
                "(model.to(ctx.device)) and move other tensors with it, or pass device='cpu'")
    if "out of memory" in text and ("CUDA" in text or "cuda" in text):
        return ("the GPU ran out of memory at this batch: lower batch_size (AllReduce's "
                "accumulate=k keeps the step's batch with batch_size/k rows a pass), use "
                "amp='bf16', or put fewer replicas on each GPU")
    return None


def _summary(e: BaseException, frames: int = 8, limit: int = 4000) -> str:
    """The innermost ``frames`` frames, torch's module-call plumbing left out."""
    tb = [f for f in traceback.extract_tb(e.__traceback__)
          if not f.filename.endswith(("torch/nn/modules/module.py",))][-frames:]
    text = "".join(traceback.format_list(tb)).rstrip()
    return text[-limit:]


def report(channel, secret: bytes, task: int, e: BaseException) -> bool:
    """Tell the driver (``channel``: its message server's address) that this task failed with
    ``e``; False when ``e`` is transient or the driver cannot be reached."""
    if channel is None or is_transient(e):
        return False
    from ..transport.channel import MessageClient
    client = MessageClient(channel, secret, timeout=5.0)
    epoch, step = WHERE["epoch"], WHERE["step"]
    sent = client.send({"type": "task_error", "task": task, "error": type(e).__name__,
                        "spark_dl": isinstance(e, SparkDLError),
                        "message": _with_fix(e)[:4000], "traceback": _summary(e),
                        "epoch": None if epoch is None else epoch + 1,
                        "step": None if step is None else step + 1})
    client.close()
    return sent


def _with_fix(e: BaseException) -> str:
    fix = fix_for(e)
    return str(e) if fix is None else f"{str(e)[:3000]}\n  what to do: {fix}"


_SPARK_DL = {"ConfigError": ConfigError, "DataError": DataError, "ResourceError": ResourceError,
             "SparkDLError": SparkDLError}
_CLASSES: dict[str, type] = {}


def _error_class(name: str, spark_dl: bool) -> type:
    """TaskError, also a subclass of the task's exception class when that is a spark_dl
    error or a builtin one (``except IndexError`` and ``except DataError`` still catch it)."""
    base = _SPARK_DL.get(name) if spark_dl else getattr(builtins, name, None)
    if not (isinstance(base, type) and issubclass(base, Exception)) or base is SparkDLError:
        return TaskError
    if name not in _CLASSES:
        try:
            _CLASSES[name] = type(name, (TaskError, base), {
                "__init__": TaskError.__init__, "__str__": Exception.__str__,
                "__module__": base.__module__, "__qualname__": base.__qualname__})
        except TypeError:                        # a layout conflict (e.g. OSError's)
            return TaskError
    return _CLASSES[name]


def task_error(m: dict) -> TaskError:
    """The error to raise on the driver for a ``task_error`` message."""
    where = "before training started" if m.get("epoch") is None else \
        f"in epoch {m['epoch']}, step {m['step']}" if m.get("step") is not None else \
        f"in epoch {m['epoch']}"
    cls = _error_class(m.get("error", ""), bool(m.get("spark_dl")))
    if m.get("spark_dl"):          # spark_dl's own errors are written for the user: first
        text = f"{m['message']} (task {m['task']}, {where})"
    else:
        text = f"task {m['task']} failed {where}: {m['error']}: {m['message']}"
    if m.get("traceback") and not m.get("spark_dl"):
        text += "\n  where it was raised (innermost last):\n" + \
            "\n".join("    " + line for line in m["traceback"].splitlines())
    return cls(text, remote_type=m["error"], task=m["task"], epoch=m.get("epoch"),
               step=m.get("step"), remote_traceback=m.get("traceback", ""))


class TaskErrors:
    """The driver's side: the first ``task_error`` message cancels the fit's Spark jobs (by
    tag), and ``raise_reported()`` raises it where the Spark action returns or fails."""

    def __init__(self, spark, tag: str):
        self.spark, self.tag = spark, tag
        self.connect = is_connect(spark)
        self.first: dict | None = None
        self._lock = threading.Lock()

    def on_message(self, m: dict) -> bool:
        """True when ``m`` was a task error (handled here)."""
        if m.get("type") != "task_error":
            return False
        with self._lock:
            if self.first is not None:
                return True
            self.first = m
        try:                # (a classic session's interruptTag does not reach RDD jobs)
            if self.connect:
                self.spark.interruptTag(self.tag)
            else:
                self.spark.sparkContext.cancelJobsWithTag(self.tag)
        except Exception:                        # the job may be over already
            pass
        return True

    def __enter__(self):
        if self.connect:
            self.spark.addTag(self.tag)
        else:
            self.spark.sparkContext.addJobTag(self.tag)
        return self

    def __exit__(self, *exc):
        if self.connect:
            self.spark.removeTag(self.tag)
        else:
            self.spark.sparkContext.removeJobTag(self.tag)
        return False

    def wait(self, seconds: float) -> None:
        """After the Spark action failed: the failing task's message may still be on its way
        (it is sent before the task raises)."""
        import time
        deadline = time.monotonic() + seconds
        while self.first is None and time.monotonic() < deadline:
            time.sleep(0.02)

    def raise_reported(self) -> None:
        """Raise the first task's error, if one was reported."""
        if self.first is not None:
            raise task_error(self.first) from None
