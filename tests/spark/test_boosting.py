"""The boosting parameter server with its data-key scheduler on real Spark (local[2])."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from spark_dl import Boosting, fit
from spark_dl.errors import ConfigError

from .test_allreduce import assert_same_weights, data, frame, small_fc


def _key_rows(keys, x_of_file):
    """(x, y) of every key (file URI, first, end), read back from the Parquet files."""
    from spark_dl.data.bridge import ShardData
    out = []
    for uri, a, b in keys:
        shard = ShardData.from_arrow(x_of_file(uri).slice(a, b - a).to_batches(),
                                     "features", "label", (12,))
        xk, yk = next(shard.batches(b - a, shuffle=False))
        out.append((xk.double(), yk))
    return out


@pytest.mark.parametrize("local", [pytest.param(False, marks=pytest.mark.compat), True])
def test_one_worker_applies_every_key_once_per_epoch_as_one_step(spark, tmp_path, local):
    # one worker: the server's steps are one per key in the scheduler's order, each the sum of
    # the key's n_push mini-batch mean gradients (local: each taken after the earlier ones
    # stepped the worker's copy by lr); replayed in one process, float64
    from spark_dl.strategies.boosting.driver import cut_keys
    x, y = data(80, seed=3)
    # fresh: the worker asks before every mini-batch whether the server moved (with one
    # worker it never has: the replay stays exact)
    res = fit(frame(spark, x, y, [80]), small_fc,
              strategy=Boosting(n_push=2, local=local, fresh=True), replicas=1,
              batch_size=8, epochs=2, lr=0.2, momentum=0.5, shuffle=False, dtype="float64",
              run_dir=tmp_path / "run", log=None)
    keys = res.info["keys"]
    assert keys["count"] == 5 and keys["rows_per_key"] == 16     # 80 rows in keys of 2 x 8
    served = keys["served"]
    assert [sorted(k for k, _ in ep) for ep in served] == [list(range(5))] * 2
    files = sorted(str(p.resolve().as_uri()) for p in (tmp_path / "run" / "data")
                   .glob("*.parquet"))
    cut = cut_keys(files, 16)
    rows = _key_rows(cut, lambda uri: pq.read_table(uri.removeprefix("file://")))
    torch.manual_seed(0)
    ref = small_fc().double()
    opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.5)
    copy = small_fc().double()
    for ep in served:
        for k, _ in ep:
            xk, yk = rows[k]
            copy.load_state_dict(ref.state_dict())
            total = [torch.zeros_like(p) for p in ref.parameters()]
            for a in range(0, len(xk), 8):            # the key's mini-batches in order
                copy.zero_grad()
                torch.nn.functional.cross_entropy(copy(xk[a:a + 8]), yk[a:a + 8]).backward()
                with torch.no_grad():
                    for t, p in zip(total, copy.parameters()):
                        t += p.grad
                        if local:
                            p -= 0.2 * p.grad
            for p, t in zip(ref.parameters(), total):
                p.grad = t
            opt.step()
    assert res.info["local_steps"] is local and res.info["fresh"] is True
    assert res.info["workers"][0]["rebased"] == 0
    assert res.info["workers"][0]["fresh_asks"] == 20      # asked before every mini-batch
    assert_same_weights(res.model, ref)
    assert res.info["server"]["versions"] == [10] and res.info["server"]["dropped_stale"] == 0
    assert [h["keys_per_worker"] for h in res.history] == [[5], [5]]


def test_two_workers_share_the_keys_of_a_parquet_dataset_exactly_once(spark, tmp_path):
    x, y = data(320, seed=5)
    path = tmp_path / "ds"
    frame(spark, x, y, [160, 160]).write.parquet(str(path))
    df = spark.read.parquet(str(path))
    # 4 epochs: which worker takes which key, and so the order of the pushes, depends on the
    # machine's load; after 2 the model was still mid-climb, and one run ended at 0.5
    res = fit(df, small_fc, strategy="boosting", batch_size=8, epochs=4, lr=0.3,
              momentum=0.5, validation=(x[:64], y[:64]), run_dir=tmp_path / "run", log=None)
    keys = res.info["keys"]
    assert keys["files"] == len(df.inputFiles())                # its own files, not a copy
    assert not (tmp_path / "run" / "data").exists()
    for ep in keys["served"]:                                   # every key once per epoch
        assert sorted(k for k, _ in ep) == list(range(keys["count"]))
    per_worker = keys["keys_per_worker"]
    assert all(sum(ep) == keys["count"] for ep in per_worker)
    assert sum(r["rows"] for r in res.info["workers"]) == 4 * 320
    assert len(res.history) == 4 and res.history[-1]["val_accuracy"] > 0.6
    # both workers ran (which takes how many keys depends on when each started: a fast one
    # may take them all)
    assert res.info["world"] == 2 and [r["worker"] for r in res.info["workers"]] == [0, 1]
    # fresh by default with two workers: each asks before every mini-batch it trains
    # (whether the other had pushed meanwhile depends on the timing)
    assert res.info["fresh"] is True
    assert all(r["fresh_asks"] == r["rows"] // 8 and r["rebased"] <= r["fresh_asks"]
               for r in res.info["workers"])
    # beside the driver they read the server's version from shared memory and ask only
    # when it has moved: every ask sent brings newer values
    assert all(r["board"] and r["asks_sent"] == r["rebased"] for r in res.info["workers"])
    assert not (tmp_path / "run" / "ps-versions").exists()         # gone with the server


@pytest.mark.parametrize("rule, rate", [("dana", 1.0)])
def test_the_dana_rule_moves_the_momentum_to_the_workers(spark, tmp_path, rule, rate):
    """staleness="dana": the server steps plainly at fit's rate (2 workers), each worker
    carries fit's momentum over its pushes, reporting it as its ramp grows it (twice with
    4-batch keys: 2/3 of fit's 0.5 after one, all of it after two), the server sending the
    look-ahead, and the fit still learns."""
    x, y = data(320, seed=6)
    res = fit(frame(spark, x, y, [160, 160]), small_fc,
              strategy=Boosting(staleness=rule, n_push=4),
              batch_size=8, epochs=3, lr=0.3, momentum=0.5, validation=(x[:64], y[:64]),
              run_dir=tmp_path / "run", log=None)
    assert (res.info["server_momentum"], res.info["worker_momentum"],
            res.info["server_rate"], res.info["look_ahead"]) == (0.0, 0.5, rate, rule == "dana")
    reports = sum(min(len(r["keys"]), 2) for r in res.info["workers"])   # keys it trained
    assert res.info["server"]["momentum_reports"] == (reports if rule == "dana" else 0)
    assert all(r["velocity_norm"] > 0 for r in res.info["workers"] if r["keys"])
    # the momentum's ramp: a tenth of a worker's 320 x 3 / 8 / 2 = 60 mini-batches
    assert all(r["momentum_ramp"] == 6 for r in res.info["workers"])
    assert res.history[-1]["val_accuracy"] > 0.6


# the long tier: test_a_fit_resumes_from_the_last_finished_epoch checks these ramps too
@pytest.mark.long
def test_a_resumed_fit_ramps_the_workers_momentum_over_the_epochs_it_has_left(spark,
                                                                             tmp_path):
    """Each worker's buffer starts empty in a resumed fit; its ramp is a tenth of the
    mini-batches still to come: 400 rows x 2 epochs left / 8 a batch / 2 workers = 50 -> 5
    (7 if the epoch done were counted)."""
    x, y = data(400, seed=9)
    df = frame(spark, x, y, [200, 200])
    kw = dict(strategy=Boosting(staleness="dana"), batch_size=8, lr=0.1, momentum=0.9,
              run_dir=tmp_path / "run", log=None)
    first = fit(df, small_fc, epochs=1, **kw)
    assert all(r["momentum_ramp"] == 2 for r in first.info["workers"])       # 25 -> 2
    again = fit(df, small_fc, epochs=3, **kw)
    assert again.info["resumed_from_epoch"] == 1
    assert all(r["momentum_ramp"] == 5 for r in again.info["workers"])


def test_bad_options_and_more_workers_than_keys(spark, tmp_path):
    with pytest.raises(ConfigError, match="n_push"):
        Boosting(n_push=0)
    with pytest.raises(ConfigError, match="lease_s"):
        Boosting(lease_s=0)
    with pytest.raises(ConfigError, match="fresh must be"):
        Boosting(fresh="yes")
    x, y = data(16)
    with pytest.raises(ConfigError, match="1 data keys for 2 workers"):
        fit(frame(spark, x, y, [16]), small_fc, strategy=Boosting(n_push=4), batch_size=8,
            replicas=2, run_dir=tmp_path / "run", log=None)


def test_a_fit_resumes_from_the_last_finished_epoch(spark, tmp_path):
    """The fit goes on from the server's checkpoint of epoch 1; each worker's momentum buffer
    ("dana") starts empty, its ramp a tenth of the mini-batches still to come: 384 rows x 2
    epochs left / 8 a batch / 2 workers = 48 -> 4 (7 if the epoch done were counted)."""
    x, y = data(384, seed=2)
    df = frame(spark, x, y, [192, 192])
    kw = dict(strategy=Boosting(n_push=2, staleness="dana"), batch_size=8, lr=0.1,
              momentum=0.9, run_dir=tmp_path / "run", log=None)
    first = fit(df, small_fc, epochs=1, **kw)
    assert first.info["server"]["versions"] == [24]           # 2 files of 12 keys of 16 rows
    assert all(r["momentum_ramp"] == 2 for r in first.info["workers"])       # 24 -> 2
    again = fit(df, small_fc, epochs=3, **kw)
    assert again.info["resumed_from_epoch"] == 1
    assert [h["epoch"] for h in again.history] == [1, 2, 3]
    assert again.history[0] == first.history[0]
    assert again.info["server"]["versions"] == [72]           # 24 steps an epoch, from step 24
    assert [sorted(k for k, _ in ep) for ep in again.info["keys"]["served"]] == \
        [list(range(24))] * 2
    assert all(r["momentum_ramp"] == 4 for r in again.info["workers"])
