"""Failures that explain themselves in seconds (local[2], real Spark, real gloo): what the
driver can check is checked before any Spark job; an exception in a task reaches the caller as
a spark_dl error with the task's type, message, traceback, task and step, and the fit's job is
cancelled at once; a corrupt latest checkpoint falls back to the previous one."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from spark_dl import AllReduce, Downpour, Gossip, fit
from spark_dl.errors import ConfigError, DataError, TaskError
from spark_dl.models.fc import FCNet
from spark_dl.runs import MARK

from .test_allreduce import data, frame, small_fc

FAST = 15.0           # seconds: every failure here must reach the caller sooner


class _Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        return False


def _fails(exc, match, call):
    """``call()`` raises ``exc`` matching ``match`` in under FAST seconds; returns it."""
    with _Timer() as t, pytest.raises(exc, match=match) as info:
        call()
    assert t.seconds < FAST, f"took {t.seconds:.1f} s"
    return info.value


def test_a_model_factory_that_returns_no_module_is_refused_on_the_driver(spark, tmp_path):
    x, y = data(32)
    _fails(ConfigError, "model factory returned dict, not a torch.nn.Module",
           lambda: fit(frame(spark, x, y, [16, 16]), lambda: {"w": 1}, shape=(12,),
                       run_dir=tmp_path / "r", log=None))
    _fails(ConfigError, "model factory raised ZeroDivisionError",
           lambda: fit(frame(spark, x, y, [16, 16]), lambda: FCNet((12, 1 // 0)),
                       run_dir=tmp_path / "r", log=None))
    assert not (tmp_path / "r").exists()                       # nothing was started


def test_a_model_with_fewer_outputs_than_classes(spark, tmp_path):
    x, y = data(48)                                            # labels 0..2
    two = lambda: FCNet((12, 9, 2))                            # noqa: E731
    df = frame(spark, x, y, [24, 24])
    _fails(ConfigError, r"num_classes=3 but the model outputs 2 scores per row: build it with "
                        r"3 outputs", lambda: fit(df, two, num_classes=3, log=None,
                                                  run_dir=tmp_path / "a"))
    _fails(DataError, r"validation labels go from 0 to 2, but the model outputs 2 scores",
           lambda: fit(df, two, validation=(x, y), log=None, run_dir=tmp_path / "b"))
    # nothing on the driver knows the labels: the task's loss says it, and the fit stops
    for strategy in ("allreduce", "downpour"):
        e = _fails(DataError, r"a label of 2 in this mini-batch, but the model outputs 2 scores "
                              r"per row \(cross_entropy needs labels in 0..1\)",
                   lambda: fit(df, two, strategy=strategy,  # noqa: B023 - _fails calls it
                               batch_size=8, log=None, run_dir=tmp_path / strategy))  # noqa: B023
        assert isinstance(e, TaskError) and e.remote_type == "DataError"
        assert e.task in (0, 1) and e.epoch == 1 and e.step is not None
        assert "cross_entropy" in e.remote_traceback


class Attempts(torch.nn.Module):
    """FCNet((13, 9, 3)) on 12 features (a shape error on every attempt); each task attempt
    that trains leaves a file ``task-<partition>-attempt-<n>`` in ``log``."""

    def __init__(self, log: str):
        super().__init__()
        self.net, self.log = FCNet((13, 9, 3)), log

    def forward(self, x):
        import os

        from pyspark import TaskContext
        ctx = TaskContext.get()
        if ctx is not None:
            open(os.path.join(self.log, f"task-{ctx.partitionId()}-attempt-"
                                        f"{ctx.attemptNumber()}"), "a").close()
        return self.net(x)


# the long tier: test_an_exception_in_a_task_reaches_the_caller_with_its_task_and_step checks
# the same (a fault that would fail again: one attempt of each task, in seconds) for the same
# strategies and Gossip
@pytest.mark.long
@pytest.mark.parametrize("strategy", ["allreduce", "downpour"])
def test_a_shape_error_fails_at_the_first_attempt(spark, tmp_path, strategy):
    """A fault that would fail again is not retried: one attempt of each task, in seconds."""
    x, y = data(48)
    log = tmp_path / "attempts"
    log.mkdir()
    e = _fails(ValueError, r"FCNet expects 13 input features per sample, got 12",
               lambda: fit(frame(spark, x, y, [24, 24]), lambda: Attempts(str(log)),
                           strategy=strategy, batch_size=8, log=None,
                           run_dir=tmp_path / "r"))
    assert isinstance(e, TaskError) and e.epoch == 1
    assert {p.name for p in log.iterdir()} <= {"task-0-attempt-0", "task-1-attempt-0"}
    assert list(log.iterdir())


class Explodes(torch.nn.Module):
    """Raises ZeroDivisionError in the forward of its ``at``-th training step on task 1; each
    task attempt that builds it leaves a file ``task-<partition>-attempt-<n>`` in ``log``."""

    def __init__(self, at: int, log: str):
        import os

        from pyspark import TaskContext
        super().__init__()
        self.net, self.at, self.calls = small_fc(), at, 0
        ctx = TaskContext.get()
        if ctx is not None:
            open(os.path.join(log, f"task-{ctx.partitionId()}-attempt-"
                                   f"{ctx.attemptNumber()}"), "a").close()

    def forward(self, x):
        from pyspark import TaskContext
        ctx = TaskContext.get()
        if self.training and ctx is not None and ctx.partitionId() == 1:
            self.calls += 1
            if self.calls == self.at:
                raise ZeroDivisionError("the user's model divided by zero")
        return self.net(x)


@pytest.mark.parametrize("strategy", [pytest.param(AllReduce(), marks=pytest.mark.compat),
                                      Downpour(), Gossip(alpha=0.5)],
                         ids=["allreduce", "downpour", "gossip"])
def test_an_exception_in_a_task_reaches_the_caller_with_its_task_and_step(spark, tmp_path,
                                                                         strategy):
    x, y = data(64)
    log = tmp_path / "attempts"
    log.mkdir()
    e = _fails(ZeroDivisionError, r"task 1 failed in epoch 2, step 2: ZeroDivisionError: the "
                                  r"user's model divided by zero",
               lambda: fit(frame(spark, x, y, [32, 32]), lambda: Explodes(6, str(log)),
                           strategy=strategy, batch_size=8, epochs=3, run_dir=tmp_path / "r",
                           log=None, timeout_s=120))
    assert isinstance(e, TaskError) and (e.task, e.epoch, e.step) == (1, 2, 2)
    assert "in forward" in e.remote_traceback and "raise ZeroDivisionError" in str(e)
    # a fault that would fail again is not retried: one attempt of each task
    names = {p.name for p in log.iterdir()}
    assert "task-1-attempt-0" in names and names <= {"task-0-attempt-0", "task-1-attempt-0"}
    # once the cancelled tasks are gone, the session's next Python tasks run (on pyspark 3.5
    # a reused worker could have had its socket closed by a cancelled task's monitor)
    executors = spark.sparkContext._jsc.sc().statusTracker()
    deadline = time.monotonic() + 120
    while sum(i.numRunningTasks() for i in executors.getExecutorInfos()) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert [frame(spark, x, y, [32, 32]).count() for _ in range(3)] == [64] * 3


@pytest.mark.compat
def test_an_empty_dataframe_and_bad_validation_are_refused_before_training(spark, tmp_path):
    x, y = data(24)
    empty = frame(spark, x, y, [24]).limit(0)
    _fails(DataError, r"the DataFrame has no rows: nothing to train on",
           lambda: fit(empty, small_fc, shape=(12,), run_dir=tmp_path / "a", log=None))
    df = frame(spark, x, y, [12, 12])
    _fails(DataError, r"validation x has rows of shape \(4,\) \(4 values\) but the training "
                      r"rows have shape=\(12,\)",
           lambda: fit(df, small_fc, shape=(12,), validation=(np.zeros((3, 4)), y[:3]),
                       run_dir=tmp_path / "b", log=None))
    _fails(ConfigError, r"the model cannot take rows of shape \(2, 5\): ValueError: FCNet "
                        r"expects 12 input features",
           lambda: fit(df, small_fc, shape=(2, 5), run_dir=tmp_path / "c", log=None))


def test_an_unwritable_run_directory_is_refused(spark, tmp_path):
    x, y = data(24)
    (tmp_path / "file").write_text("not a directory")
    _fails(ConfigError, r"the run directory .*file/run cannot be written",
           lambda: fit(frame(spark, x, y, [12, 12]), small_fc, run_dir=tmp_path / "file" / "run",
                       log=None))


def test_resuming_a_run_directory_of_another_model_names_the_difference(spark, tmp_path):
    x, y = data(48)
    df = frame(spark, x, y, [24, 24])
    fit(df, small_fc, batch_size=8, run_dir=tmp_path / "r", log=None)
    e = _fails(ConfigError, r"holds the checkpoint of a different fit \(parameters "
                            r"net.0.weight \(9, 12\) there, \(5, 12\) here",
               lambda: fit(df, lambda: FCNet((12, 5, 3)), batch_size=8, epochs=2,
                           run_dir=tmp_path / "r", log=None))
    assert "resume=False" in str(e)
    res = fit(df, lambda: FCNet((12, 5, 3)), batch_size=8, run_dir=tmp_path / "r",
              resume=False, log=None)                          # the offered way out works
    assert [h["epoch"] for h in res.history] == [1]
    # task 0 wrote the returned model where the driver reads; the driver's mark is gone
    assert res.info["model_via"] == "run directory" and not (tmp_path / "r" / MARK).exists()
    saved = torch.load(tmp_path / "r" / "model.pt", weights_only=True)
    assert saved.keys() == res.model.state_dict().keys()
    assert all(torch.equal(saved[k], v) for k, v in res.model.state_dict().items())
    phases = res.info["phases"]
    assert phases["epochs_s"] == pytest.approx(res.history[0]["seconds"], abs=1e-3)
    assert sum(v for k, v in phases.items() if k not in ("total_s", "outside_epochs_s")) == \
        pytest.approx(phases["total_s"], abs=0.05)


def test_a_corrupt_checkpoint_falls_back_to_the_previous_one(spark, tmp_path):
    x, y = data(48)
    df = frame(spark, x, y, [24, 24])
    kw = dict(optimizer="sgd", lr=0.3, batch_size=8, seed=1, run_dir=tmp_path / "r",
              warmup_epochs=1)              # the same scaled rate per epoch in every fit
    fit(df, small_fc, epochs=2, log=None, **kw)
    ckpt, prev = tmp_path / "r" / "checkpoint.pt", tmp_path / "r" / "checkpoint.prev.pt"
    assert torch.load(prev, weights_only=True)["epoch"] == 1
    ckpt.write_bytes(ckpt.read_bytes()[:100])                   # a truncated write
    lines = []
    with _Timer() as t:
        res = fit(df, small_fc, epochs=3, log=lines.append, **kw)
    said = "\n".join(lines)
    assert "checkpoint.pt cannot be read" in said and "resumes from the previous one" in said
    assert [h["epoch"] for h in res.history] == [1, 2, 3]      # epoch 2 trained again
    assert list((tmp_path / "r").glob("checkpoint.pt.corrupt-*"))          # kept, not lost
    clean = fit(df, small_fc, epochs=3, log=None, **{**kw, "run_dir": tmp_path / "clean"})
    for a, b in zip(res.model.state_dict().values(), clean.model.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6)
    assert t.seconds < 60
    # no good previous one: a clear error, nothing deleted
    ckpt.write_bytes(b"garbage")
    prev.write_bytes(b"garbage too")
    config = (tmp_path / "r" / "config.json").read_bytes()
    _fails(ConfigError, r"checkpoint .*checkpoint.pt cannot be read .* no good previous one "
                        r"\(checkpoint.prev.pt\): start over with resume=False",
           lambda: fit(df, small_fc, epochs=4, log=None, **kw))
    assert ckpt.read_bytes() == b"garbage"
    assert (tmp_path / "r" / "config.json").read_bytes() == config      # the run's as it was
