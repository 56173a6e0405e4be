"""Downpour SGD on real Spark (local[2]) with the driver's parameter server."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spark_dl import Downpour, fit
from spark_dl.errors import ConfigError, ResourceError
from spark_dl.models import FCNet

from .test_allreduce import assert_same_weights, data, frame, reference_epochs, small_fc


def small_ssda():
    from spark_dl.models.ssda import SSDA, LayerSpec
    return SSDA(12, (LayerSpec(9, beta=0.1, rho=0.1, weight_decay=0.0),
                     LayerSpec(5, beta=0.0, rho=1.0, weight_decay=0.0)))


class SmallRNN(torch.nn.Module):
    """The 12 features as 4 steps of 3; an Elman RNN of 2 layers of 7 units; a linear head."""

    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.RNN(3, 7, 2, batch_first=True)
        self.head = torch.nn.Linear(7, 3)

    def forward(self, x):
        out, _ = self.rnn(x.reshape(len(x), 4, 3))
        return self.head(out[:, -1])


def narrow_fc():
    """Its Linear(8, 1) is narrower than 2 partitions: kept whole."""
    return torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Sigmoid(),
                               torch.nn.Linear(8, 1), torch.nn.Tanh(), torch.nn.Linear(1, 3))


def first_three_ce(out, y):
    """Cross-entropy on the first 3 outputs (the SSDA's reconstruction as logits)."""
    return torch.nn.functional.cross_entropy(out[:, :3], y)


@pytest.mark.compat
def test_one_worker_fetch_push_every_step_is_single_process_sgd(spark, tmp_path):
    x, y = data(48, seed=7)
    res = fit(frame(spark, x, y, [48]), small_fc, strategy=Downpour(wire_dtype="float64"),
              batch_size=8, epochs=3, lr=0.5, lr_decay=0.5, momentum=0.9, shuffle=False,
              dtype="float64", run_dir=tmp_path / "run", log=None)
    # the server's learning rate halves after each epoch's 6 steps, as the scheduler's does
    assert_same_weights(res.model, reference_epochs(x, y, [48], 8, 3, 0.5, 0.9, 0.5))
    assert res.info["server"]["versions"] == [18]
    assert res.info["server"]["clip"] is None          # one worker: plain SGD, no cap
    assert res.info["staleness_histogram"] == {0: 18}
    assert res.info["overlap"] == [False]       # the default overlaps on GPUs only
    # every fetch came back with the push (one round trip per step): pulls = initial + pushes
    assert res.info["server"]["pulls"] == 1 + 18


def test_overlapped_push_is_sgd_delayed_by_one_step(spark, tmp_path):
    # with the push of step t in flight, step t+1 computes on the parameters before it:
    # w[t+1] = w[t] - lr * g(w[t-1], batch t), w[-1] = w[0]
    x, y = data(48, seed=11)
    res = fit(frame(spark, x, y, [48]), small_fc,
              strategy=Downpour(overlap=True, wire_dtype="float64"),
              batch_size=8, epochs=2, lr=0.5, shuffle=False, dtype="float64",
              run_dir=tmp_path / "run", log=None)
    torch.manual_seed(0)
    model = small_fc().double()
    xt, yt = torch.from_numpy(x.astype(np.float64)), torch.from_numpy(y)
    previous = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        for s in range(6):
            current = [p.detach().clone() for p in model.parameters()]
            with torch.no_grad():
                for p, old in zip(model.parameters(), previous):
                    p.copy_(old)
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(xt[s * 8:(s + 1) * 8]),
                                              yt[s * 8:(s + 1) * 8]).backward()
            with torch.no_grad():
                for p, cur in zip(model.parameters(), current):
                    p.copy_(cur - 0.5 * p.grad)
            previous = current
    assert_same_weights(res.model, model)
    # every push but the first was computed on the parameters before the previous push
    assert res.info["staleness_histogram"] == {0: 1, 1: 11}
    assert res.info["overlap"] == [True]


@pytest.mark.parametrize("algorithm", ["collective", "master"])
def test_model_parallel_replica_is_single_process_sgd_on_the_union_of_its_batches(spark,
                                                                                   tmp_path,
                                                                                   algorithm):
    # one replica split over 2 tasks by columns; step s trains on both tasks' batch s, with
    # the all-gather layers or with the master algorithm (the thesis's §3.2)
    x, y = data(40, seed=12)
    res = fit(frame(spark, x, y, [24, 16]), small_fc,
              strategy=Downpour(partitions=2, wire_dtype="float64", model_parallel=algorithm),
              replicas=1, batch_size=8, epochs=2, lr=0.5, lr_decay=0.5, momentum=0.9,
              shuffle=False, dtype="float64", run_dir=tmp_path / "run", log=None)
    assert res.info["model_parallel"]["algorithm"] == algorithm
    assert_same_weights(res.model, reference_epochs(x, y, [24, 16], 8, 2, 0.5, 0.9, 0.5))
    assert res.info["server"]["shards"] == 2 and res.info["server"]["versions"] == [6, 6]
    tasks = res.info["workers"]
    assert [t["partition"] for t in tasks] == [0, 1]
    total = sum(p.numel() for p in res.model.parameters()) * 8
    for t in tasks:                       # each task held about half of the parameters
        assert t["model_parallel"]["parameter_bytes"] <= total / 2 + 8 * 64
        assert t["model_parallel"]["communication"]["total_messages"] > 0
    assert [h["epoch"] for h in res.history] == [1, 2]


@pytest.mark.parametrize("partitions", [1, 2])
def test_a_fit_resumes_from_the_servers_checkpoint_exactly(spark, tmp_path, partitions):
    """The driver checkpoints the server every epoch; fit with the same run_dir goes on at the
    next epoch with the server's values, momentum buffers, versions and lr schedule: 2 + 2
    epochs equal 4 uninterrupted ones (one replica, so the pushes come in one order), which
    are single-process SGD on the union of the tasks' batches (as an uninterrupted fit is:
    test_one_worker_fetch_push_every_step_is_single_process_sgd and
    test_model_parallel_replica_is_single_process_sgd_on_the_union_of_its_batches)."""
    x, y = data(40, seed=14)
    splits = [40] if partitions == 1 else [24, 16]
    kw = dict(strategy=Downpour(partitions=partitions, wire_dtype="float64"), replicas=1,
              batch_size=8, lr=0.5, lr_decay=0.8, momentum=0.9, shuffle=False, dtype="float64",
              log=None)
    first = fit(frame(spark, x, y, splits), small_fc, epochs=2, run_dir=tmp_path / "r", **kw)
    assert first.info["resumed_from_epoch"] is None
    again = fit(frame(spark, x, y, splits), small_fc, epochs=4, run_dir=tmp_path / "r", **kw)
    assert again.info["resumed_from_epoch"] == 2
    assert [h["epoch"] for h in again.history] == [1, 2, 3, 4]
    assert [w["resumed_at"]["epoch"] for w in again.info["workers"]] == [3] * partitions
    assert_same_weights(again.model, reference_epochs(x, y, splits, 8, 4, 0.5, 0.9, 0.8))
    steps = max(-(-n // 8) for n in splits)                  # 5, or 3 on the split replica
    assert again.info["server"]["versions"] == [4 * steps] * partitions
    # a checkpoint that does not fit the model is refused, and resume=False starts over
    with pytest.raises(ConfigError, match=r"holds the checkpoint of a different fit "
                                          r"\(parameters net.0.weight \(9, 12\) there"):
        fit(frame(spark, x, y, splits), lambda: FCNet((12, 5, 3)), epochs=1,
            run_dir=tmp_path / "r", **kw)
    if partitions == 1:             # the same driver path for a split replica: once
        fresh = fit(frame(spark, x, y, splits), small_fc, epochs=2, run_dir=tmp_path / "r",
                    resume=False, **kw)
        assert fresh.info["resumed_from_epoch"] is None
        assert_same_weights(fresh.model, first.model)


def test_a_resumed_fit_ramps_the_workers_momentum_over_the_steps_it_has_left(spark,
                                                                            tmp_path):
    """The default rule's buffers start empty in a resumed fit; each worker's ramp is a tenth
    of its mini-batches still to come: 25 a worker an epoch x 2 epochs left = 50 -> 5 (7 if
    the epoch done were counted)."""
    x, y = data(400, seed=15)
    kw = dict(strategy="downpour", replicas=2, batch_size=8, lr=0.1, momentum=0.9,
              run_dir=tmp_path / "run", log=None)
    first = fit(frame(spark, x, y, [200, 200]), small_fc, epochs=1, **kw)
    assert all(r["momentum_ramp"] == 2 for r in first.info["workers"])       # 25 -> 2
    again = fit(frame(spark, x, y, [200, 200]), small_fc, epochs=3, **kw)
    assert again.info["resumed_from_epoch"] == 1
    assert all(r["momentum_ramp"] == 5 for r in again.info["workers"])


# the RNN in the long tier: its column-partitioned layer equals the whole one in
# tests/unit/test_model_parallel_zoo.py (2 and 3 ranks), the server cuts and merges it in
# test_cut_and_merge_the_ssda_rnn_and_a_kept_whole_layer, and a split replica's fit is SGD on
# the union in test_model_parallel_replica_is_single_process_sgd_on_the_union_of_its_batches
@pytest.mark.parametrize("model_fn,loss,kept", [
    (small_ssda, first_three_ce, []),
    pytest.param(SmallRNN, "cross_entropy", [], marks=pytest.mark.long),
    (narrow_fc, "cross_entropy", ["2"])])
def test_model_parallel_ssda_rnn_and_kept_whole_replicas_are_sgd_on_the_union(
        spark, tmp_path, model_fn, loss, kept):
    x, y = data(40, seed=13)
    res = fit(frame(spark, x, y, [24, 16]), model_fn, loss=loss,
              strategy=Downpour(partitions=2, wire_dtype="float64"), replicas=1, batch_size=8,
              epochs=2, lr=0.5, momentum=0.9, shuffle=False, dtype="float64",
              run_dir=tmp_path / "run", log=None)
    ref = reference_epochs(x, y, [24, 16], 8, 2, 0.5, 0.9, model_fn=model_fn,
                           loss=first_three_ce if callable(loss) else
                           torch.nn.functional.cross_entropy)
    assert_same_weights(res.model, ref)
    assert res.info["model_parallel"]["kept_whole"] == kept


def test_sync_mode_follows_the_allreduce_trajectory(spark, tmp_path):
    # uneven shards (9 and 4 steps an epoch, a short last batch each): a round waits for the
    # replicas still training, and the even split is the same path with equal counts
    splits = [70, 30]
    x, y = data(sum(splits), seed=8)
    kw = dict(batch_size=8, epochs=2, lr=0.3, lr_decay=0.7, momentum=0.9, shuffle=False,
              dtype="float64", log=None, grad_clip=None)   # the sync server does not cut
    ring = fit(frame(spark, x, y, splits), small_fc, run_dir=tmp_path / "ring", **kw)
    ps = fit(frame(spark, x, y, splits), small_fc,
             strategy=Downpour(mode="sync", wire_dtype="float64", ps_shards=3),
             run_dir=tmp_path / "ps", validation=(x, y), validate_every=0.5, **kw)
    # both scale the rate for 2 replicas' batch (the linear rule, its warmup): step by step
    assert_same_weights(ps.model, ring.model, tol=1e-9)
    assert [h["lr"] for h in ps.history] == pytest.approx([h["lr"] for h in ring.history])
    assert ps.info["lr_schedule"]["scaled_lr"] == pytest.approx(0.6)
    assert [e["epoch"] for e in ps.info["evals"]] == pytest.approx([0.5, 1, 1.5, 2], abs=0.1)
    assert ps.info["evals"][-1]["val_accuracy"] == pytest.approx(ps.history[-1]["val_accuracy"])
    steps = max(-(-n // 8) for n in splits)
    assert ps.info["server"]["versions"] == [2 * steps] * 3
    assert ps.info["server"]["dropped_stale"] == 0
    # sync rounds keep fit's momentum at the server, whatever the staleness rule, and return
    # the last values (no average)
    assert ps.info["staleness"] == "dana"
    assert (ps.info["server_momentum"], ps.info["worker_momentum"], ps.info["average"]) == \
        (0.9, 0.0, 0.0)


def test_async_workers_train_the_cnn_and_report_staleness(spark, mnist, tmp_path):
    images, labels = mnist
    x = images[:2400].reshape(2400, -1).astype(np.float32) / 255
    vx, vy = images[-500:].reshape(500, -1).astype(np.float32) / 255, labels[-500:]
    lines = []
    res = fit(frame(spark, x, labels[:2400], [1200, 1200]), "cnn",
              strategy=Downpour(n_fetch=2, n_push=2, ps_shards=2),
              shape=(1, 28, 28), num_classes=10, optimizer="adam", lr=0.003, batch_size=32,
              epochs=3, validation=(vx, vy), run_dir=tmp_path / "run", log=lines.append)
    assert [h["epoch"] for h in res.history] == [1, 2, 3]
    assert res.history[-1]["val_accuracy"] > 0.5           # chance: 0.1
    hist = res.info["staleness_histogram"]
    pushes = sum(w["pushes"] for w in res.info["workers"])
    assert sum(hist.values()) == pushes * 2                # one entry per push and shard
    assert res.info["server"]["versions"] == [pushes] * 2
    # the default cap of several asynchronous replicas (a push at most 2x the running norm)
    assert res.info["server"]["clip"] == 2.0
    assert 0 <= res.info["server"]["clipped_steps"] <= pushes * 2
    assert any(line.startswith("epoch 3:") for line in lines)
    with torch.no_grad():
        acc = (res.model(torch.from_numpy(vx).reshape(-1, 1, 28, 28)).argmax(1).numpy()
               == vy).mean()
    assert abs(acc - res.history[-1]["val_accuracy"]) < 1e-9


def test_sequential_mode_applies_every_push_in_turn(spark, tmp_path):
    x, y = data(64, seed=9)
    res = fit(frame(spark, x, y, [32, 32]), small_fc,
              strategy=Downpour(mode="sequential", n_push=2), batch_size=4, epochs=1, lr=0.1,
              run_dir=tmp_path / "run", log=None)
    # each worker: 8 mini-batches, pushed 2 at a time
    assert [w["pushes"] for w in res.info["workers"]] == [4, 4]
    assert res.info["server"]["versions"] == [8]


@pytest.mark.parametrize("mode", ["async", "sequential"])
def test_a_fit_served_from_the_event_loop_applies_every_push(spark, tmp_path, monkeypatch,
                                                             mode):
    """From LOOP_FROM workers on (8) the server serves them from one event-loop thread
    (docs/design/0013-ps-event-loop.md); the shared session runs 2 tasks
    at once, so the threshold comes down to 2 here: every push of the tasks applied once."""
    from spark_dl.transport.ps import server as ps_server
    monkeypatch.setattr(ps_server, "LOOP_FROM", 2)
    x, y = data(128, seed=5)
    res = fit(frame(spark, x, y, [64, 64]), small_fc, strategy=Downpour(mode=mode),
              batch_size=4, epochs=2, lr=0.05, run_dir=tmp_path / "run", log=None)
    server = res.info["server"]
    assert server["serving"] == "loop" and server["rejected_connections"] == 0
    pushes = sum(w["pushes"] for w in res.info["workers"])
    assert pushes == 2 * 16 * 2 and server["versions"] == [pushes] == [server["pushes"]]
    assert sum(res.info["staleness_histogram"].values()) == pushes
    assert all(np.isfinite(h["loss"]) for h in res.history)
    drawn = {line.get_label(): line for line in res.plot().axes[0].get_lines()}
    for w in (0, 1):                    # the run's plot: every step of each worker
        assert np.allclose(drawn[f"worker {w} loss"].get_xdata(), np.arange(1, 33) / 16)


def test_master_algorithm_refuses_what_it_cannot_run(spark):
    x, y = data(16)
    df = frame(spark, x, y, [8, 8])
    kw = dict(strategy=Downpour(partitions=2, model_parallel="master"), log=None)
    with pytest.raises(ConfigError, match="runs FC nets"):
        fit(df, narrow_fc_conv, **kw)
    with pytest.raises(ConfigError, match="a layer of 1 units cannot go over partitions=2"):
        fit(df, lambda: FCNet((12, 1, 3)), **kw)
    with pytest.raises(ConfigError, match="needs one hidden activation"):
        fit(df, narrow_fc, **kw)
    with pytest.raises(ConfigError, match="softmax cross-entropy"):
        fit(df, small_fc, loss=first_three_ce, **kw)
    with pytest.raises(ConfigError, match="give partitions=F"):
        Downpour(partitions=1, model_parallel="thesis")        # the former name, accepted
    with pytest.raises(ConfigError,
                       match="model_parallel must be one of 'collective', 'master' "
                             r"\('thesis' is accepted as 'master'\), got 'megatron'"):
        Downpour(partitions=2, model_parallel="megatron")


def narrow_fc_conv():
    return torch.nn.Sequential(torch.nn.Unflatten(1, (1, 12)), torch.nn.Conv1d(1, 2, 3),
                               torch.nn.Flatten(), torch.nn.Linear(20, 3))


def test_downpour_argument_errors(spark):
    x, y = data(20)
    df = frame(spark, x, y, [10, 10])
    with pytest.raises(ConfigError, match="mode must be one of 'async', 'sync', 'sequential', "
                                          "got 'eventual'"):
        Downpour(mode="eventual")
    with pytest.raises(ConfigError, match="n_fetch must be an integer >= 1"):
        Downpour(n_fetch=0)
    with pytest.raises(ConfigError, match="optimizer 'cg' has no parameter-server form"):
        fit(df, small_fc, strategy="downpour", optimizer="cg")
    for strategy in ("Downpour", "Boosting"):
        with pytest.raises(ConfigError, match=f"nesterov=True with {strategy}: its staleness "
                                              f"rule decides where the momentum runs"):
            fit(df, small_fc, strategy=strategy.lower(), momentum=0.9, nesterov=True)
    with pytest.raises(ConfigError, match=r"nesterov=True is SGD's Nesterov momentum: it "
                                          r"needs optimizer='sgd' and momentum > 0, got "
                                          r"optimizer='sgd', momentum=0.0"):
        fit(df, small_fc, nesterov=True)
    with pytest.raises(ConfigError, match=r"needs optimizer='sgd' .*optimizer='adam'"):
        fit(df, small_fc, optimizer="adam", momentum=0.9, nesterov=True)
    with pytest.raises(ConfigError, match="nesterov must be True or False, got 'yes'"):
        fit(df, small_fc, momentum=0.9, nesterov="yes")
    with pytest.raises(ConfigError, match=r"momentum must be in \[0, 1\), got 1.5"):
        fit(df, small_fc, momentum=1.5)
    with pytest.raises(ConfigError, match="overlap=True needs mode='async'"):
        Downpour(mode="sync", overlap=True)
    with pytest.raises(ConfigError, match="partitions > 1 runs modes 'async' and"):
        Downpour(mode="sync", partitions=2)
    with pytest.raises(ResourceError, match="replicas=2 x partitions=2 = 4 tasks"):
        fit(df, small_fc, strategy=Downpour(partitions=2), replicas=2)
    with pytest.raises(ConfigError, match=r"layer 1 \(Conv1d\) has no column-partitioned"):
        fit(df, narrow_fc_conv, strategy=Downpour(partitions="auto"), shape=(12,))
    with pytest.raises(ConfigError, match=r"partitions is an option of the Downpour strategy: "
                                          r"pass strategy=Downpour\(partitions=\.\.\.\)"):
        fit(df, small_fc, partitions=2)
    with pytest.raises(ConfigError, match="wire_dtype must be"):
        Downpour(wire_dtype="int8")
    with pytest.raises(ConfigError, match="average must be a number >= 0"):
        Downpour(average=-0.1)
    with pytest.raises(ConfigError, match=r"average=0.1 needs mode='async'"):
        Downpour(mode="sync", average=0.1)
    with pytest.raises(ConfigError, match=r"staleness must be one of 'halfway', 'lr', "
                                          r"'none', 'dana', got 'tau'"):
        Downpour(staleness="tau")
    with pytest.raises(ConfigError, match=r"staleness='worker\+short' was removed; use "
                                          r"'dana' \(the default"):
        Downpour(staleness="worker+short")
    with pytest.raises(ConfigError, match=r"overlap=True with staleness='none' and server "
                                          r"momentum 0.9 over 2 replicas diverges"):
        fit(df, small_fc, strategy=Downpour(overlap=True, staleness="none"), replicas=2,
            momentum=0.9)


def test_staleness_rule_sets_the_server_momentum(spark, tmp_path):
    """Two async replicas with momentum 0.9. The default, "dana": each worker carries fit's
    momentum over its pushes and reports it, the server steps them plainly at fit's rate
    and sends the look-ahead; "halfway" runs the server at the mean of 1 - 2 x (1 - 0.9) =
    0.8 and 0.9 - (1 - 1/2) = 0.4, 0.6 on CPUs (the driver guesses device='auto' from this
    machine: GPU workers overlap their pushes, a version more stale: 0.5); "none" keeps 0.9;
    sync rounds keep 0.9 (asserted in test_sync_mode_follows_the_allreduce_trajectory). The
    rules removed ("worker+short", "worker", "momentum", "step")
    are ConfigErrors (tests/unit/test_ps.py)."""
    x, y = data(32, seed=12)
    df = frame(spark, x, y, [16, 16])
    kw = dict(replicas=2, batch_size=8, epochs=1, lr=0.1, momentum=0.9, log=None)
    default = fit(df, small_fc, strategy="downpour", run_dir=tmp_path / "a", **kw)
    gpu = torch.cuda.is_available()
    assert default.info["staleness"] == "dana"
    assert (default.info["server_momentum"], default.info["worker_momentum"],
            default.info["server_rate"], default.info["overlap"], default.info["look_ahead"]) \
        == (0.0, 0.9, 1.0, [gpu] * 2, True)
    assert default.history[0]["lr"] == pytest.approx(0.1)
    # each worker reported its momentum once: 0 for its first push (the ramp of a tenth of
    # its 2 mini-batches, at least 1), 0.9 from its second
    assert default.info["server"]["momentum_reports"] == 2
    halfway = fit(df, small_fc, strategy=Downpour(staleness="halfway"),
                  run_dir=tmp_path / "f", **kw)
    assert halfway.info["server_momentum"] == pytest.approx(0.5 if gpu else 0.6)
    assert (halfway.info["worker_momentum"], halfway.info["server_rate"]) == (0.0, 1.0)
    assert halfway.history[0]["lr"] == pytest.approx(0.1)
    plain = fit(df, small_fc, strategy=Downpour(staleness="none"), run_dir=tmp_path / "b",
                **kw)
    assert plain.info["server_momentum"] == 0.9
    # each default worker carried a buffer ("halfway"'s carry none), its momentum ramped over
    # a tenth of its 2 mini-batches, at least 1
    assert all(r["velocity_norm"] > 0 and r["momentum_ramp"] == 1
               for r in default.info["workers"])
    assert all(r["velocity_norm"] is None and r["momentum_ramp"] is None
               for r in halfway.info["workers"])
    # the returned model averages the server's values over 0.1 epoch by default in async
    # mode (with one worker too), never in sync rounds (test_sync_mode_follows_the_allreduce_
    # trajectory)
    assert (default.info["average"], plain.info["average"]) == (0.1, 0.1)


def test_auto_partitions_plan_with_a_probed_link(spark, tmp_path):
    x, y = data(32, seed=13)
    lines = []
    res = fit(frame(spark, x, y, [16, 16]), small_fc, strategy=Downpour(partitions="auto"),
              batch_size=8, epochs=1, lr=0.1, run_dir=tmp_path / "run", log=lines.append)
    plan = next(line for line in lines if line.startswith("partitions='auto'"))
    # no memory limit is set, so the small net is not split: two data-parallel replicas
    assert "F=1, R=2" in plan and "us per message" in plan
    assert res.info["partitions"] == 1 and res.info["world"] == 2
