"""The data-key scheduler (seed 000): every key exactly once per epoch, a faster worker takes
more keys, a dead worker's key is served again (to its retry, or to anyone after the lease)."""

from __future__ import annotations

import threading

import pytest

from spark_dl.errors import ConfigError
from spark_dl.strategies.boosting.keys import KeyScheduler


def test_every_key_once_per_epoch_and_the_faster_worker_takes_more():
    s = KeyScheduler(12, epochs=2, workers=2, seed=1)
    t = 0.0
    # worker 0 finishes a key every tick, worker 1 every third tick
    busy = {}
    while not s.finished:
        t += 1
        for w, every in ((0, 1), (1, 3)):
            if w in busy and t - busy[w] >= every:
                s.applied(w)
                del busy[w]
            if w not in busy:
                got = s.next(w, now=t)
                if "key" in got:
                    busy[w] = t
    assert len(s.served) == 2
    for ep in s.served:
        assert sorted(k for k, _ in ep) == list(range(12))
    per_worker = s.state()["keys_per_worker"]
    assert all(a > 2 * b for a, b in per_worker)              # ~3x the keys of the slow one
    assert [k for k, _ in s.served[0]] != [k for k, _ in s.served[1]]  # reshuffled


def test_a_retried_worker_gets_its_unfinished_key_and_none_is_trained_twice():
    s = KeyScheduler(4, epochs=1, workers=2, seed=0)
    k0 = s.next(0, now=0)["key"]
    k1 = s.next(1, now=0)["key"]
    # worker 1 dies before its push; Spark retries it: it gets the same key back
    assert s.next(1, now=1) == {"key": k1, "epoch": 0}
    assert s.applied(1) == k1 and s.applied(0) == k0
    rest = [s.next(0, now=2)["key"], s.next(1, now=2)["key"]]
    s.applied(0), s.applied(1)
    assert s.finished and sorted([k0, k1, *rest]) == [0, 1, 2, 3]
    assert s.state()["reissued"] == 1


def test_a_worker_gone_for_good_loses_its_key_after_the_lease():
    s = KeyScheduler(2, epochs=1, workers=2, seed=0, lease_s=10)
    lost = s.next(1, now=0)["key"]
    other = s.next(0, now=0)["key"]
    s.applied(0)
    assert s.next(0, now=5) == {"wait": 0.05}                # the epoch's last key is out
    assert s.next(0, now=11) == {"key": lost, "epoch": 0}    # its lease ran out
    assert s.applied(1) is None                              # the late push is not counted
    assert s.applied(0) == lost and s.finished and {lost, other} == {0, 1}


def test_more_workers_than_keys_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"3 data keys for 4 workers.*more keys"):
        KeyScheduler(3, epochs=1, workers=4)


def test_concurrent_workers_see_each_key_once():
    s = KeyScheduler(200, epochs=3, workers=4, seed=2)

    def work(w):
        while True:
            got = s.next(w)
            if got.get("finished"):
                return
            if "key" in got:
                s.applied(w)
    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [sorted(k for k, _ in ep) for ep in s.served] == [list(range(200))] * 3


def test_boosting_options_name_the_value_and_the_choices():
    from spark_dl import Boosting
    with pytest.raises(ConfigError, match=r"staleness must be one of 'halfway', 'lr', "
                                          r"'none', 'dana', got 'fast'"):
        Boosting(staleness="fast")
    with pytest.raises(ConfigError, match="local must be True or False, got 1"):
        Boosting(local=1)
    with pytest.raises(ConfigError, match=r"average must be a number >= 0 .* got -1"):
        Boosting(average=-1)
    with pytest.raises(ConfigError, match=r"clip must be None \(the default\), 0 \(off\) or a number > 0 .* got True"):
        Boosting(clip=True)


@pytest.mark.parametrize("workers, expected", [
    (1, (0.9, 0.0, 1.0)),   # one worker: fit's momentum at the server
    (2, (0.0, 0.9, 1.0)),
    (4, (0.0, 0.9, 1.0)),
    (8, (0.0, 0.9, 0.5)),
    (16, (0.0, 0.9, 0.5)),
])
def test_boostings_default_rule_is_downpours_look_ahead(workers, expected):
    from spark_dl import Boosting
    from spark_dl.strategies.boosting.driver import staleness_rule
    # "dana" (fit's momentum at the workers, fit's rate up to 4 workers, half of it from 8)
    # on keys of 2 mini-batches
    assert (Boosting().staleness, Boosting().n_push) == ("dana", 2)
    assert staleness_rule(Boosting().staleness, 0.9, workers, "momentum") == \
        pytest.approx(expected)
    # "halfway": the server keeps a lowered momentum, the workers none
    assert staleness_rule("halfway", 0.9, 2, "momentum") == pytest.approx((0.6, 0.0, 1.0))


def test_downpour_clip_names_the_value_and_the_mode():
    from spark_dl import Downpour
    with pytest.raises(ConfigError, match=r"clip must be None \(the default\), 0 \(off\) or a number > 0 .* got -2"):
        Downpour(clip=-2)
    with pytest.raises(ConfigError, match=r"clip cuts single pushes: .* got mode='sync'"):
        Downpour(mode="sync", clip=2.0)
    assert Downpour(mode="sequential", clip=2).clip == 2
    Downpour(mode="sync", clip=0)                        # off: allowed in any mode
    from spark_dl.strategies.ps_rules import server_clip
    assert server_clip(None, 2, "async") == 2.0          # the default: several async replicas
    assert server_clip(None, 1, "async") is None         # one worker stays plain SGD
    assert server_clip(None, 2, "sequential") is None
    assert server_clip(0, 2, "async") is None and server_clip(3, 1, "async") == 3.0


def test_a_key_reads_its_rows_and_each_row_group_is_decoded_once(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from spark_dl.data.bridge import ShardData
    from spark_dl.strategies.boosting.task import _Files, read_key
    path = tmp_path / "part-0.parquet"
    pq.write_table(pa.table({"x": list(range(35)), "y": [i * 2 for i in range(35)]}), path,
                   row_group_size=10)                     # groups of rows 0-9, ..., 30-34
    uri = path.as_uri()
    where = []

    def decode(batches, at):
        where.append(at)
        return ShardData.from_arrow(batches, "x", "y", where=at)

    files = _Files(budget=1 << 20, decode=decode)
    for first, end in ((0, 4), (8, 23), (30, 35), (8, 23), (4, 8)):
        rows = read_key(files, (uri, first, end), ["x", "y"])
        assert rows.features.tolist() == list(range(first, end))      # (8, 23): 3 groups
        assert rows.labels.tolist() == [2 * i for i in range(first, end)]
    assert files.decoded == 4                            # every group once, then from memory
    assert where == [f"row group {g} of {uri}" for g in (0, 1, 2, 3)]
    arrow = pq.ParquetFile(path).read_row_groups([0], columns=["x", "y"]).nbytes
    small = _Files(budget=arrow, decode=decode)          # room for one group
    for first, end in ((0, 4), (12, 14), (0, 4)):
        read_key(small, (uri, first, end), ["x", "y"])
    assert small.decoded == 3 and len(small.groups) == 1   # group 0 was dropped for group 1
    assert small.held <= small.budget
    files.close()
    small.close()


def test_a_row_group_larger_than_the_budget_converts_only_the_keys_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from spark_dl.data.bridge import ShardData
    from spark_dl.errors import DataError
    from spark_dl.strategies.boosting.task import _Files, read_key
    path = tmp_path / "part-0.parquet"
    x = [float(i) for i in range(20)]
    x[15] = float("nan")                                  # in group 1, outside key (10, 14)
    pq.write_table(pa.table({"x": x, "y": list(range(20))}), path, row_group_size=10)
    uri = path.as_uri()
    files = _Files(budget=16,                             # below any group: none is kept
                   decode=lambda batches, at: ShardData.from_arrow(batches, "x", "y", where=at))
    for first, end in ((10, 14), (2, 12), (10, 14)):
        rows = read_key(files, (uri, first, end), ["x", "y"])
        assert rows.features.tolist() == x[first:end] and rows.labels.tolist() == \
            list(range(first, end))
    assert files.decoded == 4 and not files.groups and files.held == 0
    with pytest.raises(DataError, match=r"row 1 of the rows 4-8 of row group 1 of "
                                        r"file:///.*part-0.parquet holds NaN"):
        read_key(files, (uri, 14, 18), ["x", "y"])
    files.close()


def test_a_bad_row_is_named_by_its_row_group_and_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from spark_dl.data.bridge import ShardData
    from spark_dl.errors import DataError
    from spark_dl.strategies.boosting.task import _Files, read_key
    path = tmp_path / "part-0.parquet"
    pq.write_table(pa.table({"x": [1.0, 2.0, float("nan"), 4.0], "y": [0, 1, 0, 1]}), path,
                   row_group_size=2)
    files = _Files(budget=1 << 20,
                   decode=lambda batches, at: ShardData.from_arrow(batches, "x", "y", where=at))
    assert read_key(files, (path.as_uri(), 0, 2), ["x", "y"]).features.tolist() == [1.0, 2.0]
    with pytest.raises(DataError, match=r"row 0 of the row group 1 of file:///.*part-0.parquet "
                                        r"holds NaN"):
        read_key(files, (path.as_uri(), 2, 4), ["x", "y"])
    files.close()


def test_a_key_over_row_groups_of_other_row_lengths_is_a_ragged_column_and_none_is_empty(
        tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from spark_dl.data.bridge import ShardData
    from spark_dl.errors import DataError
    from spark_dl.strategies.boosting.task import _Files, read_key
    path = tmp_path / "part-0.parquet"
    pq.write_table(pa.table({"x": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0, 7.0], [8.0, 9.0, 0.0]],
                             "y": [0, 1, 0, 1]}), path, row_group_size=2)
    files = _Files(budget=1 << 20,
                   decode=lambda batches, at: ShardData.from_arrow(batches, "x", "y", where=at))
    uri = path.as_uri()
    assert read_key(files, (uri, 2, 4), ["x", "y"]).features.shape == (2, 3)   # one group
    with pytest.raises(DataError, match=r"column 'x': rows of the key of rows 1-3 of "
                                        r"file:///.*part-0.parquet have different lengths "
                                        r"\[2, 3\]; give shape= or fix the ragged rows"):
        read_key(files, (uri, 1, 3), ["x", "y"])
    empty = read_key(files, (uri, 4, 6), ["x", "y"])     # past the file's rows: none
    assert len(empty) == 0 and empty.labels is not None and len(empty.labels) == 0
    files.close()
