"""The all-reduce engine on real Spark (local[2]) with real gloo process groups."""

from __future__ import annotations

import io
import itertools
import json
import warnings

import numpy as np
import pytest
import torch

from spark_dl import AllReduce, fit
from spark_dl.data import arrays_to_arrow
from spark_dl.errors import ConfigError, DataError, ResourceError
from spark_dl.models.fc import FCNet
from spark_dl.runs import save_figure

SCHEMA = "features array<float>, label long"


def frame(spark, x, y, splits):
    """A DataFrame whose partitions hold consecutive rows of (x, y), ``splits`` rows each."""
    bounds = np.cumsum([0] + list(splits))

    def rows(batches):             # one input row per partition: the split's index
        for b in batches:
            for i in b.column("id").to_numpy():
                lo, hi = bounds[i], bounds[i + 1]
                if hi > lo:
                    yield arrays_to_arrow(x[lo:hi], y[lo:hi])
    return spark.range(len(splits), numPartitions=len(splits)).mapInArrow(rows, SCHEMA)


def small_fc():
    return FCNet((12, 9, 3), act="sigmoid")


def data(n, seed=0):
    g = np.random.default_rng(seed)
    x = g.normal(size=(n, 12)).astype(np.float32)
    y = (x[:, :3].argmax(1)).astype(np.int64)
    return x, y


def assert_same_weights(a, b, tol=1e-9):
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(p.double(), q.double(), atol=tol, rtol=0), name


@pytest.mark.parametrize("transport,used", [("auto", "shm"), ("process_group", "gloo")])
def test_two_replicas_equal_single_process_with_double_batch(spark, tmp_path, transport, used):
    x, y = data(96)
    res = fit(frame(spark, x, y, [48, 48]), small_fc, strategy=AllReduce(transport=transport),
              batch_size=8, epochs=2, lr=0.5, momentum=0.9, shuffle=False, dtype="float64",
              lr_scaling=None,
              run_dir=tmp_path / "run", log=None)
    assert res.info["transport"] == used
    # the backend follows the devices the tasks reported (CPU here: gloo; see test_device)
    assert (res.info["backend"], res.info["backend_why"]) == ("gloo", "gloo: CPU tasks")
    # the tasks' statuses were gathered by the driver (Spark's allGather answers in >= 1 s)
    assert res.info["rendezvous"] == "driver"
    assert res.info["devices"] == ["cpu", "cpu"]
    # 2 epochs x 6 steps; the reference replays the same order each epoch.
    assert_same_weights(res.model, reference_epochs(x, y, [48, 48], 8, 2, 0.5, 0.9))
    assert res.info["world"] == 2 and res.info["rows_per_replica"] == [48, 48]
    assert res.info["steps_per_epoch"] == 6 and res.info["allreduce_calls"] == 12
    # each call carries the gradients, the loss and the count (float64)
    numel = sum(p.numel() for p in small_fc().parameters())
    assert res.info["allreduce_bytes"] == 12 * (numel + 2) * 8
    assert [h["samples"] for h in res.history] == [96, 96]


def test_two_replicas_step_nesterovs_momentum_when_asked(spark, tmp_path):
    """fit(nesterov=True): the replicas' optimizer is SGD with Nesterov's momentum, equal to
    one process's on the double batch (and not to the classic momentum's)."""
    x, y = data(96, seed=3)
    res = fit(frame(spark, x, y, [48, 48]), small_fc, batch_size=8, epochs=2, lr=0.5,
              momentum=0.9, nesterov=True, shuffle=False, dtype="float64", lr_scaling=None,
              run_dir=tmp_path / "run", log=None)
    assert_same_weights(res.model, reference_epochs(x, y, [48, 48], 8, 2, 0.5, 0.9,
                                                    nesterov=True))
    classic = reference_epochs(x, y, [48, 48], 8, 2, 0.5, 0.9)
    assert not torch.allclose(next(res.model.parameters()).double(),
                              next(classic.parameters()).double(), atol=1e-6)


def reference_epochs(x, y, splits, batch, epochs, lr, momentum, lr_decay=1.0, model_fn=None,
                     loss=torch.nn.functional.cross_entropy, schedule=None, clip=None,
                     nesterov=False):
    """Single-process SGD (Nesterov's momentum if ``nesterov``) where step s trains on batch
    s of every split (the union); the rate decays per epoch, or follows ``schedule(fractional
    epoch)``; ``clip(grads)`` before each step."""
    torch.manual_seed(0)
    model = (model_fn or small_fc)().double()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, nesterov=nesterov)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, lr_decay)
    bounds = np.cumsum([0] + list(splits))
    xt, yt = torch.from_numpy(x.astype(np.float64)), torch.from_numpy(y)
    steps = max(-(-n // batch) for n in splits)
    for e in range(epochs):
        for s in range(steps):
            if schedule is not None:
                opt.param_groups[0]["lr"] = schedule(e + s / steps)
            idx = np.concatenate([np.arange(lo, hi)[s * batch:(s + 1) * batch]
                                  for lo, hi in itertools.pairwise(bounds)])
            opt.zero_grad()
            loss(model(xt[idx]), yt[idx]).backward()
            if clip is not None:
                clip([p.grad for p in model.parameters()])
            opt.step()
        sched.step()
    return model


@pytest.mark.parametrize("average", [0.0, 0.8])
def test_batchnorm_replicas_return_and_validate_with_their_mean_statistics(spark, tmp_path,
                                                                           average):
    """Each replica's BatchNorm keeps running statistics of its own shard's batches; the model
    validated (each replica a part of the rows) and returned holds their mean. By hand: two
    copies stepped by the mean of their gradients, each normalising its own batches; with
    ``average``, the parameters returned are their moving average (over 0.8 x 3 steps: a
    lerp from the second step on), and the statistics are the averaged weights' own: each
    replica's over its first mini-batches (here all 3), as torch's swa_utils.update_bn
    computes them, their mean weighted by the rows (24 each)."""
    import copy

    from spark_dl.optim.average import WeightAverage

    from .test_gossip import small_bn
    x, y = data(48, seed=8)
    res = fit(frame(spark, x, y, [24, 24]), small_bn, strategy=AllReduce(average=average),
              batch_size=8, epochs=2, lr=0.3, momentum=0.9, shuffle=False, dtype="float64",
              lr_scaling=None, validation=(x[:13], y[:13]), run_dir=tmp_path / "run",
              log=None)
    torch.manual_seed(0)
    copies = [small_bn().double()]
    copies.append(copy.deepcopy(copies[0]))
    opts = [torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9) for m in copies]
    avg = WeightAverage(list(copies[0].parameters()), average or 1.0, epoch_steps=3)
    xt, yt = torch.from_numpy(x.astype(np.float64)), torch.from_numpy(y)
    for _epoch in range(2):
        for s in range(3):
            grads = []
            for r, m in enumerate(copies):
                m.zero_grad()
                idx = np.arange(24 * r, 24 * r + 24)[s * 8:(s + 1) * 8]
                torch.nn.functional.cross_entropy(m(xt[idx]), yt[idx]).backward()
                grads.append([p.grad.clone() for p in m.parameters()])
            for m, o in zip(copies, opts):
                for p, g0, g1 in zip(m.parameters(), *grads):
                    p.grad = (g0 + g1) / 2
                o.step()
            avg.update()
    ref = copies[0]
    for name, b in ref.named_buffers():
        if b.is_floating_point():
            b.copy_((b + dict(copies[1].named_buffers())[name]) / 2)
    if average:
        assert not torch.allclose(avg.current()[0], next(ref.parameters()))
        with torch.no_grad():
            for p, v in zip(ref.parameters(), avg.current()):
                p.copy_(v)
        live = {k: b.clone() for k, b in ref.named_buffers()}
        own = []
        for r in range(2):
            m = copy.deepcopy(ref)
            loader = [xt[24 * r + 8 * s:24 * r + 8 * (s + 1)] for s in range(3)]
            torch.optim.swa_utils.update_bn(loader, m)
            own.append(dict(m.named_buffers()))
        with torch.no_grad():
            for k, b in ref.named_buffers():
                if b.is_floating_point():
                    b.copy_((own[0][k] + own[1][k]) / 2)
                    assert not torch.allclose(b, live[k])     # not the live statistics
                else:                                         # the steps the live model took
                    assert torch.equal(dict(res.model.named_buffers())[k], live[k])
    assert_same_weights(res.model, ref)                  # running_mean and running_var too
    ref.eval()
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(ref(xt[:13]), yt[:13])
    assert res.history[-1]["val_loss"] == pytest.approx(float(want), rel=1e-9)


def test_tasks_that_cannot_gather_through_the_driver_all_take_sparks_allgather(
        spark, tmp_path, monkeypatch):
    """The driver gives up on a round at once (as when a task cannot reach it): every task of
    the stage falls back to BarrierTaskContext.allGather, and the fit is the same (the one
    process's on the double batch, which the driver's rendezvous gives in
    test_two_replicas_equal_single_process_with_double_batch)."""
    from spark_dl.transport.channel import StatusGather
    x, y = data(48, seed=5)
    monkeypatch.setattr(StatusGather, "PATIENCE_S", 0.0)
    slow = fit(frame(spark, x, y, [24, 24]), small_fc, batch_size=8, epochs=1, lr=0.1,
               shuffle=False, dtype="float64", lr_scaling=None, run_dir=tmp_path / "b",
               log=None)
    assert slow.info["rendezvous"] == "spark"
    assert_same_weights(slow.model, reference_epochs(x, y, [24, 24], 8, 1, 0.1, 0.0))


def test_linear_scaling_with_warmup_is_the_scheduled_big_batch(spark, tmp_path):
    """Two replicas under the linear rule: the one-process big batch at k = 2 times the rate,
    reached by a warmup over the first epoch, step by step, its gradient cut at twice its
    running mean norm (grad_clip="auto", written out here by hand); the history records each
    epoch's rate, the validation curve comes every half epoch."""
    x, y = data(96, seed=7)
    mean = []

    def relative_clip(grads):              # spark_dl.optim.clip's "auto" rule
        norm = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])))
        if mean and norm > 2 * mean[0]:
            for g in grads:
                g.mul_(2 * mean[0] / norm)
        mean[:] = [0.95 * mean[0] + 0.05 * min(norm, 2 * mean[0]) if mean else norm]
    res = fit(frame(spark, x, y, [48, 48]), small_fc, batch_size=8, epochs=2, lr=0.2,
              momentum=0.9, lr_decay=0.5, lr_scaling="linear", warmup_epochs=1,
              shuffle=False, dtype="float64", validation=(x, y), validate_every=0.5,
              run_dir=tmp_path / "run", log=None)

    def lr(t):                               # 0.2 -> 0.4 over epoch 0, then 0.4 x 0.5
        return 0.5 ** int(t) * (0.2 + 0.2 * min(t, 1.0))
    assert_same_weights(res.model, reference_epochs(x, y, [48, 48], 8, 2, 0.2, 0.9,
                                                    schedule=lr, clip=relative_clip))
    assert res.info["grad_clip"]["clipped_steps"] >= 1       # the cut made a difference
    assert [h["lr"] for h in res.history] == pytest.approx([lr(5 / 6), lr(1 + 5 / 6)])
    assert res.info["lr_schedule"]["scaled_lr"] == pytest.approx(0.4)
    evals = res.info["evals"]
    assert [e["epoch"] for e in evals] == [0.5, 1.0, 1.5, 2.0]
    assert all(a["train_seconds"] < b["train_seconds"] for a, b in itertools.pairwise(evals))
    assert evals[-1]["val_accuracy"] == res.history[-1]["val_accuracy"]


@pytest.mark.compat
def test_uneven_shards_weighted_average_is_the_full_batch_gradient(spark, tmp_path):
    x, y = data(100, seed=1)
    res = fit(frame(spark, x, y, [70, 30]), small_fc, batch_size=100, epochs=1, lr=1.0,
              shuffle=False, dtype="float64", lr_scaling=None, run_dir=tmp_path / "run", log=None)
    torch.manual_seed(0)
    ref = small_fc().double()
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    ref.zero_grad()
    torch.nn.functional.cross_entropy(ref(torch.from_numpy(x.astype(np.float64))),
                                      torch.from_numpy(y)).backward()
    for (name, p), after in zip(ref.named_parameters(), res.model.state_dict().values()):
        # one SGD step with lr 1: before - after is exactly the averaged gradient
        assert torch.allclose(before[name] - after, p.grad, atol=1e-9, rtol=0), name
    # the unweighted mean of the two shards' gradients is measurably different
    assert res.info["rows_per_replica"] == [70, 30]


def test_uneven_shards_with_mini_batches_join_semantics(spark, tmp_path):
    x, y = data(100, seed=2)
    res = fit(frame(spark, x, y, [70, 30]), small_fc, batch_size=16, epochs=1, lr=0.3,
              momentum=0.5, shuffle=False, dtype="float64",
              lr_scaling=None, run_dir=tmp_path / "run", log=None)
    assert res.info["steps_per_epoch"] == 5
    assert_same_weights(res.model, reference_epochs(x, y, [70, 30], 16, 1, 0.3, 0.5))


def test_accumulation_equals_the_bigger_batch(spark, tmp_path):
    x, y = data(64, seed=3)
    res = fit(frame(spark, x, y, [32, 32]), small_fc, strategy=AllReduce(accumulate=2),
              batch_size=4, epochs=1, lr=0.5, shuffle=False, dtype="float64", lr_scaling=None,
              run_dir=tmp_path / "run", log=None)
    assert res.info["steps_per_epoch"] == 4
    assert_same_weights(res.model, reference_epochs(x, y, [32, 32], 8, 1, 0.5, 0.0))


@pytest.mark.parametrize("accumulate,batch", [(1, 8), (2, 4)])
def test_one_replica_steps_as_the_plain_loop(spark, tmp_path, accumulate, batch):
    """One replica has nothing to reduce: its own step (no buckets), the same weights and loss
    as single-process SGD with the same batches, with or without accumulation (34 rows: the
    last step is short)."""
    x, y = data(34, seed=4)
    res = fit(frame(spark, x, y, [34]), small_fc, strategy=AllReduce(accumulate=accumulate),
              batch_size=batch, epochs=2, lr=0.3, momentum=0.9, shuffle=False,
              dtype="float64", lr_scaling=None, replicas=1, run_dir=tmp_path / "run", log=None)
    assert res.info["buckets"] == 0 and res.info["transport"] == "none"
    # averaged weights by default, over 0.1 x 5 steps: the last weights, as the plain loop's
    assert res.info["average"] == 0.1
    ref = reference_epochs(x, y, [34], 8, 2, 0.3, 0.9)
    assert_same_weights(res.model, ref)
    assert [h["samples"] for h in res.history] == [34, 34]
    torch.manual_seed(0)
    start = small_fc().double()               # epoch 1's mean loss, recomputed
    opt = torch.optim.SGD(start.parameters(), lr=0.3, momentum=0.9)
    xt, yt, total = torch.from_numpy(x.astype(np.float64)), torch.from_numpy(y), 0.0
    for i in range(0, 34, 8):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(start(xt[i:i + 8]), yt[i:i + 8])
        total += float(loss.detach()) * len(yt[i:i + 8])
        loss.backward()
        opt.step()
    assert res.history[0]["loss"] == pytest.approx(total / 34, rel=1e-9)


def test_cnn_trains_on_mnist_and_writes_the_run(spark, mnist, tmp_path):
    images, labels = mnist
    x = images[:4000].reshape(4000, -1).astype(np.float32) / 255
    y = labels[:4000]
    vx, vy = images[-500:].reshape(500, -1).astype(np.float32) / 255, labels[-500:]
    lines = []
    res = fit(frame(spark, x, y, [2000, 2000]), "cnn", shape=(1, 28, 28), num_classes=10,
              batch_size=32, epochs=3, optimizer="adam", lr=0.003, validation=(vx, vy),
              run_dir=tmp_path / "run", log=lines.append)
    assert res.history[-1]["loss"] < res.history[0]["loss"] < 2.3
    assert res.history[-1]["val_accuracy"] > 0.75
    assert res.info["devices"] == ["cpu", "cpu"]
    run = res.run_dir
    for name in ("config.json", "metrics.jsonl", "history.csv", "loss.png", "checkpoint.pt",
                 "model.pt", "info.json", "workers/rank-0.json", "workers/rank-1.json"):
        assert (run / name).exists(), name
    epochs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()
              if json.loads(ln)["type"] == "epoch"]
    assert [e["epoch"] for e in epochs] == [1, 2, 3]
    assert any(line.startswith("epoch 3:") for line in lines)
    # loss.png is res.plot(): a point per step and one per epoch, the validation on its axes
    fig = res.plot()
    png = io.BytesIO()
    save_figure(fig, png)
    assert png.getvalue() == (run / "loss.png").read_bytes()
    train, val, val_right = fig.axes
    drawn = {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}
    steps = res.history[0]["steps"]
    xs, ys = drawn["loss per step"].get_xdata(), drawn["loss per step"].get_ydata()
    assert np.allclose(xs, np.arange(1, 3 * steps + 1) / steps)
    assert np.all(np.isfinite(ys)) and ys[-steps:].mean() < ys[:steps].mean()
    assert list(drawn["loss per epoch (mean)"].get_ydata()) == [h["loss"] for h in res.history]
    assert list(drawn["loss"].get_ydata()) == [h["val_loss"] for h in res.history]
    assert list(drawn["accuracy"].get_ydata()) == [h["val_accuracy"] for h in res.history]
    assert drawn["accuracy"].axes is val_right and drawn["loss"].axes is val
    assert {1, 2, 3} <= set(val.get_xticks()) and val.get_xlabel() == "epoch"
    for ax in (train, val, val_right):
        lo, hi = ax.get_ylim()
        assert sum(lo <= t <= hi for t in ax.get_yticks()) >= 3 and ax.get_ylabel()
    # the driver-side model predicts like the replica's
    with torch.no_grad():
        acc = (res.model(torch.from_numpy(vx).reshape(-1, 1, 28, 28)).argmax(1).numpy()
               == vy).mean()
    assert abs(acc - res.history[-1]["val_accuracy"]) < 1e-9
    # each replica validated half of the rows; their sums are the whole's
    assert res.info["validated_by"] == "2 replicas, a part each"
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(
            res.model(torch.from_numpy(vx).reshape(-1, 1, 28, 28)), torch.from_numpy(vy))
    assert abs(float(loss) - res.history[-1]["val_loss"]) < 1e-5


def test_resume_from_checkpoint_continues_training(spark, tmp_path):
    """A fit resumed from the checkpoint of its first epoch ends where an uninterrupted one
    ends, the one process's on the double batch replayed by hand: the weights, the momentum
    and, under the scaled rate (linear: 2 x 0.5, no warmup), the cut's running mean come back
    (spark_dl.optim.clip's "auto" rule, written out here), with cuts in both epochs."""
    x, y = data(96, seed=7)
    df = frame(spark, x, y, [48, 48])
    kw = dict(batch_size=8, lr=0.5, momentum=0.9, shuffle=False, dtype="float64",
              lr_scaling="linear", warmup_epochs=0, log=None)
    first = fit(df, small_fc, epochs=1, run_dir=tmp_path / "cut", **kw)
    again = fit(df, small_fc, epochs=2, run_dir=tmp_path / "cut", **kw)
    assert first.info["resumed_from_epoch"] is None
    assert again.info["resumed_from_epoch"] == 1 and len(again.history) == 2
    mean, cuts = [], []

    def relative_clip(grads):
        norm = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])))
        cuts.append(bool(mean and norm > 2 * mean[0]))
        if cuts[-1]:
            for g in grads:
                g.mul_(2 * mean[0] / norm)
        mean[:] = [0.95 * mean[0] + 0.05 * min(norm, 2 * mean[0]) if mean else norm]
    assert_same_weights(again.model, reference_epochs(x, y, [48, 48], 8, 2, 1.0, 0.9,
                                                      clip=relative_clip))
    assert again.info["grad_clip"] == {**first.info["grad_clip"], "clipped_steps": sum(cuts),
                                       "steps": 12}
    assert sum(cuts) > first.info["grad_clip"]["clipped_steps"] == sum(cuts[:6]) > 0


def test_the_validated_and_returned_model_is_the_weights_moving_average(spark, tmp_path):
    """AllReduce(average=a): training steps the last weights as without it (the same losses),
    and the model validated and returned is their moving average over the last a of an
    epoch's steps (spark_dl.optim.average), replayed here step by step, read at every epoch's
    end as the fit does; a = 3.2 makes a window of 64 steps in the second epoch, which takes
    the values every other step. The averaged fit is cut after its first epoch and resumed:
    it carries the average on (1 + 1 epochs equal the 2 replayed)."""
    from spark_dl.optim.average import WeightAverage, interval
    assert interval(3.2, 20, 40) == 2
    x, y = data(160, seed=11)
    df = frame(spark, x, y, [80, 80])
    kw = dict(batch_size=4, epochs=2, lr=0.3, momentum=0.9, shuffle=False, dtype="float64",
              lr_scaling=None, validation=(x[:30], y[:30]), log=None)
    last = fit(df, small_fc, strategy=AllReduce(average=0), run_dir=tmp_path / "last", **kw)
    fit(df, small_fc, strategy=AllReduce(average=3.2), run_dir=tmp_path / "avg",
        **{**kw, "epochs": 1})
    res = fit(df, small_fc, strategy=AllReduce(average=3.2), run_dir=tmp_path / "avg", **kw)
    assert res.info["resumed_from_epoch"] == 1
    assert (last.info["average"], res.info["average"]) == (0.0, 3.2)
    assert [h["loss"] for h in res.history] == [h["loss"] for h in last.history]
    ref = reference_epochs(x, y, [80, 80], 4, 2, 0.3, 0.9)
    assert_same_weights(last.model, ref)
    torch.manual_seed(0)                        # the replay: 20 steps an epoch, window <= 10
    model = small_fc().double()
    avg = WeightAverage(list(model.parameters()), 3.2, epoch_steps=20)
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    xt, yt = torch.from_numpy(x.astype(np.float64)), torch.from_numpy(y)
    for _epoch in range(2):
        for s in range(20):
            idx = np.concatenate([np.arange(0, 80)[s * 4:(s + 1) * 4],
                                  np.arange(80, 160)[s * 4:(s + 1) * 4]])
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xt[idx]), yt[idx]).backward()
            opt.step()
            avg.update()
        avg.current()                           # the fit's read at the epoch's end
    assert avg.steps == 40 and avg.pending == 0
    assert_same_weights(model, ref)
    for p, a in zip(res.model.parameters(), avg.current()):
        assert torch.allclose(p.double(), a, atol=1e-9, rtol=0)
    assert not torch.allclose(next(res.model.parameters()).double(),
                              next(ref.parameters()))
    with torch.no_grad():                       # validated: the model returned
        want = torch.nn.functional.cross_entropy(res.model(xt[:30]), yt[:30])
    assert res.history[-1]["val_loss"] == pytest.approx(float(want), rel=1e-9)
    assert AllReduce().average is None          # the default: 0.1 of an epoch (asserted in
    # test_one_replica_steps_as_the_plain_loop), none for a line search's steps
    lbfgs = fit(df, small_fc, optimizer="lbfgs", lr=0.5, epochs=1, batch_size=40,
                dtype="float64", lr_scaling=None, run_dir=tmp_path / "lbfgs", log=None)
    assert lbfgs.info["average"] == 0.0


def weight_normed_fc():
    with warnings.catch_warnings():                 # the old API, still common in audio nets
        warnings.simplefilter("ignore", FutureWarning)
        return torch.nn.Sequential(torch.nn.utils.weight_norm(torch.nn.Linear(12, 9)),
                                   torch.nn.Sigmoid(), torch.nn.Linear(9, 3))


def test_the_average_of_a_model_a_deep_copy_cannot_copy(spark, tmp_path):
    """torch.nn.utils.weight_norm's computed weight is not a leaf after a forward (the
    balancer's or the first step's), so a deep copy fails: the averaged copy is made by the
    model's maker instead, and the default fit validates and returns the average."""
    x, y = data(80, seed=13)
    res = fit(frame(spark, x, y, [40, 40]), weight_normed_fc, batch_size=8, epochs=1,
              lr=0.3, validation=(x[:20], y[:20]), run_dir=tmp_path / "wn", log=None)
    assert res.info["average"] == 0.1
    assert {"0.weight_g", "0.weight_v"} <= set(dict(res.model.named_parameters()))
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(
            res.model(torch.from_numpy(x[:20])), torch.from_numpy(y[:20]))
    assert res.history[-1]["val_loss"] == pytest.approx(float(want), rel=1e-5)


def test_bad_input_is_reported_before_training(spark, tmp_path):
    x, y = data(40, seed=5)
    x[25, 3] = np.nan
    with pytest.raises(DataError,
                       match=r"task 1: column .features.: row 5 of the partition 1 holds NaN"):
        fit(frame(spark, x, y, [20, 20]), small_fc, num_classes=3, run_dir=tmp_path / "a",
            log=None)
    x, y = data(40, seed=5)
    y[3] = 7
    with pytest.raises(DataError, match=r"label 7, outside 0..2"):
        fit(frame(spark, x, y, [20, 20]), small_fc, num_classes=3, run_dir=tmp_path / "b",
            log=None)


def test_argument_errors_name_the_fix(spark, tmp_path):
    x, y = data(20)
    df = frame(spark, x, y, [10, 10])
    with pytest.raises(ConfigError, match="unknown strategy 'ring'"):
        fit(df, small_fc, strategy="ring")
    with pytest.raises(ConfigError, match=r"optimizer must be one of sgd, .*, got 'adamw'"):
        fit(df, small_fc, optimizer="adamw")
    with pytest.raises(ResourceError, match="replicas=5 but the cluster runs 2"):
        fit(df, small_fc, replicas=5)
    with pytest.raises(DataError, match="column 'pixels' not in the DataFrame"):
        fit(df, small_fc, features="pixels")
    with pytest.raises(ValueError, match="unknown model 'resnet'"):
        fit(df, "resnet")
    with pytest.raises(ConfigError, match="amp must be"):
        AllReduce(amp="int8")
    with pytest.raises(ConfigError, match=r"lr_scaling must be one of .*, got 'cubic'"):
        fit(df, small_fc, lr_scaling="cubic")
    with pytest.raises(ConfigError, match=r"warmup_epochs must be .* >= 0, got -0.5"):
        fit(df, small_fc, warmup_epochs=-0.5)
    with pytest.raises(ConfigError, match=r"warmup_epochs=3 is longer than the fit"):
        fit(df, small_fc, epochs=2, warmup_epochs=3)
    with pytest.raises(ConfigError, match=r"grad_clip must be 'auto', None \(off\) or a "):
        fit(df, small_fc, grad_clip=-1.0)
    with pytest.raises(ConfigError, match=r"grad_clip=1.0 cuts .*pass Downpour\(clip=...\) .*"
                                          r"a synchronous server does not cut"):
        fit(df, small_fc, strategy="downpour", grad_clip=1.0)
    with pytest.raises(ConfigError, match=r"grad_clip=2.0 with optimizer 'lbfgs': its line"):
        fit(df, small_fc, optimizer="lbfgs", grad_clip=2.0)
    with pytest.raises(ConfigError, match=r"validate_every must be a fraction .*, got 0"):
        fit(df, small_fc, validate_every=0)


def test_empty_partition_joins_with_zero_samples(spark, tmp_path):
    x, y = data(30, seed=6)
    res = fit(frame(spark, x, y, [30, 0]), small_fc, batch_size=10, epochs=1, lr=0.5,
              shuffle=False, dtype="float64", lr_scaling=None, run_dir=tmp_path / "run", log=None)
    assert res.info["rows_per_replica"] == [30, 0]
    assert_same_weights(res.model, reference_epochs(x, y, [30, 0], 10, 1, 0.5, 0.0))


def test_mnist_job_with_the_allreduce_strategy(spark, tmp_path):
    from spark_dl.config import load_toml
    from spark_dl.recipes.mnist import MnistJobConfig, train_mnist

    from ..conftest import MNIST_IMAGES, MNIST_LABELS, ROOT
    cfg = load_toml(MnistJobConfig, ROOT / "conf/jobs/cnn.toml", {
        "data.images": str(MNIST_IMAGES), "data.labels": str(MNIST_LABELS),
        "data.extended_samples": 2000, "data.n_train_source": 1000, "train.epochs": 2,
        "train.strategy": "allreduce", "run.out_dir": str(tmp_path), "run.device": "cpu"})
    r = train_mnist(cfg, log=lambda s: None, spark=spark)
    assert r["replicas"] == 2 and r["train_samples"] == 3000 and len(r["history"]) == 2
    assert r["history"][1]["loss"] < r["history"][0]["loss"] and r["test_accuracy"] > 0.3
    assert (tmp_path / "cnn-sgd-allreduce" / "checkpoint.pt").exists()


@pytest.mark.parametrize("strategy,partitions,seq_len", [("allreduce", 1, 25),
                                                       ("allreduce", 1, 100),
                                                       ("downpour", 1, 100),
                                                       ("downpour", 2, 100)])
def test_char_lstm_job_on_spark_carries_the_state_across_windows(spark, tmp_path, strategy,
                                                                 partitions, seq_len):
    from spark_dl.config import load_toml
    from spark_dl.recipes.charlm import CharConfig, train_char

    from ..conftest import ROOT
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((ROOT / "data/text/tinyshakespeare.txt").read_text()[:15000])
    cfg = load_toml(CharConfig, ROOT / "conf/jobs/char_lstm.toml", {
        "corpus": str(corpus), "hidden": 32, "layers": 1, "seq_len": seq_len, "tbptt": 25,
        "batch_size": 16, "updates": 40, "sample_len": 40, "strategy": strategy,
        "partitions": partitions, "optimizer": "rmsprop",
        "run.out_dir": str(tmp_path / "out"), "run.device": "cpu"})
    r = train_char(cfg, log=lambda s: None, spark=spark)
    # 13,500 training characters over 2 tasks, each read as 16 / F streams of 25-character
    # windows: 16 steps per epoch (F = 1), 33 (F = 2), cut to whole sequences of
    # seq_len / 25 windows; epochs enough for the 40 updates (at least 2)
    carry = seq_len // 25
    steps = 16 if partitions == 1 else 33
    steps -= steps % carry
    assert r["carried_windows"] == carry and r["updates"] == steps * r["epochs"] >= 40
    assert r["epochs"] >= 2
    assert r["replicas"] == 2 // partitions and r["batch_size"] == 16
    assert r["history"][-1]["loss"] < r["history"][0]["loss"] < np.log(r["vocab"])
    assert r["val_loss"] < np.log(r["vocab"]) and len(r["sample"]) == 7 + 40


def test_char_windows_come_in_stream_order(spark, tmp_path):
    """Row j of step s is window s of stream j: each window continues the one a step before."""
    from spark_dl.data import CharVocab
    from spark_dl.recipes.charlm import _window_frame

    from ..conftest import ROOT
    path = tmp_path / "corpus.txt"          # the first 6,000 characters: the tasks read it whole
    path.write_text((ROOT / "data/text/tinyshakespeare.txt").read_text()[:6000])
    text = path.read_text()
    vocab = CharVocab.from_text(text)
    ids = vocab.encode(text)[:5000]
    df = _window_frame(spark, str(path), vocab.to_json(), 0, 5000, 10, 2, 4, 3)
    parts = df.rdd.glom().collect()
    assert len(parts) == 2
    for p, part in enumerate(parts):
        x = np.array([r.features for r in part])
        y = np.array([r.label for r in part])
        assert len(x) % (4 * 3) == 0                      # whole sequences of 3 windows
        steps = x.reshape(-1, 4, 10)                       # (step, stream, T)
        # stream j of partition p starts at p * 2500 + j * L, L = 2499 // 4 characters
        np.testing.assert_array_equal(steps[0], [ids[p * 2500 + j * 624:][:10]
                                                 for j in range(4)])
        np.testing.assert_array_equal(y[:, :-1], x[:, 1:])  # targets shifted by one
        for s in range(1, len(steps)):
            # the next window of a stream starts with the previous window's last target
            np.testing.assert_array_equal(steps[s, :, 0], y.reshape(-1, 4, 10)[s - 1, :, -1])


def test_bf16_autocast_keeps_float32_master_weights(spark, tmp_path):
    x, y = data(96, seed=10)
    res = fit(frame(spark, x, y, [48, 48]), small_fc, strategy=AllReduce(amp="bf16"),
              batch_size=8, epochs=3, lr=0.5, run_dir=tmp_path / "run", log=None)
    assert all(p.dtype == torch.float32 for p in res.model.parameters())
    assert res.history[-1]["loss"] < res.history[0]["loss"]


def test_recomputing_the_averages_statistics_leaves_training_as_it_was(spark, tmp_path):
    """A BatchNorm model whose transform draws random noise: the statistics pass over the
    first mini-batches at each validation calls the transform too, yet the training losses
    are those of average=0, which makes no such pass (the generators are kept)."""
    from .test_gossip import small_bn

    def noisy(x, y):
        x = torch.as_tensor(x)
        return x + 0.05 * torch.randn(x.shape, dtype=x.dtype), torch.as_tensor(y)

    x, y = data(64, seed=12)
    kw = dict(batch_size=8, epochs=2, lr=0.3, momentum=0.9, dtype="float64", lr_scaling=None,
              validation=(x[:13], y[:13]), validate_every=0.5, transform=noisy, log=None)
    runs = [fit(frame(spark, x, y, [32, 32]), small_bn, strategy=AllReduce(average=a),
                run_dir=tmp_path / str(a), **kw) for a in (0, 0.5)]
    assert [h["loss"] for h in runs[0].history] == [h["loss"] for h in runs[1].history]
    assert runs[0].history[-1]["val_loss"] != runs[1].history[-1]["val_loss"]
    # a pass at each of the 4 validations; the result is the last one's model, no fifth pass
    assert [r.info["statistics_passes"] for r in runs] == [0, 4]
    with torch.no_grad():
        out = runs[1].model.eval()(torch.as_tensor(x[:13], dtype=torch.float64))
    assert float(torch.nn.functional.cross_entropy(out, torch.as_tensor(y[:13]))) == \
        pytest.approx(runs[1].history[-1]["val_loss"], abs=1e-12)
