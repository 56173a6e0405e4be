import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from spark_dl.data import extended_mnist, read_shards, shard_files, write_shards
from spark_dl.errors import DataError


def test_write_read_round_trip_through_pyarrow(spark, mnist, tmp_path):
    x, y = mnist
    df = extended_mnist(spark, x[:200], y[:200], n=500, partitions=3, seed=2)
    out = tmp_path / "shards"
    manifest = write_shards(df, str(out))
    assert manifest["rows"] == 500 and len(manifest["shards"]) == 3
    files = shard_files(str(out))
    assert sorted(rows for _, rows in files) == [166, 167, 167]
    assert all(p.startswith("file:///") for p, _ in files)
    assert sum(pq.ParquetFile(p.removeprefix("file://")).metadata.num_rows for p, _ in files) == 500
    back = read_shards(spark, str(out))
    assert back.count() == 500
    def pixel_sums(frame):
        return np.sort([np.frombuffer(r, np.uint8).sum() for r in frame.toPandas()["features"]])
    np.testing.assert_array_equal(pixel_sums(df), pixel_sums(back))
    assert json.loads((out / "_manifest.json").read_text())["format"] == "spark_dl.shards/1"


def test_existing_dir_empty_partitions_and_overwrite(spark, mnist, tmp_path):
    x, y = mnist
    out = str(tmp_path / "s")
    write_shards(extended_mnist(spark, x[:50], y[:50], n=2, partitions=5), out)
    with pytest.raises(DataError, match="already exists; pass mode='overwrite'"):
        write_shards(extended_mnist(spark, x[:50], y[:50], n=2, partitions=5), out)
    m = write_shards(extended_mnist(spark, x[:50], y[:50], n=3, partitions=5), out,
                     mode="overwrite")
    assert m["rows"] == 3 and len(m["shards"]) == 3          # empty partitions: no file
    assert read_shards(spark, out).count() == 3


def test_overwrite_refuses_a_directory_that_is_not_a_shard_dir(spark, mnist, tmp_path):
    x, y = mnist
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(DataError, match=r"refusing to overwrite .*no _manifest.json"):
        write_shards(extended_mnist(spark, x[:50], y[:50], n=5, partitions=2), str(tmp_path),
                     mode="overwrite")
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_relative_paths_resolve_on_the_driver(spark, mnist, tmp_path, monkeypatch):
    x, y = mnist
    monkeypatch.chdir(tmp_path)
    write_shards(extended_mnist(spark, x[:50], y[:50], n=10, partitions=2), "rel/shards")
    assert sorted(p.name for p in (tmp_path / "rel" / "shards").iterdir()) == \
        ["_manifest.json", "shard-00000.parquet", "shard-00001.parquet"]
    assert read_shards(spark, "rel/shards").count() == 10


def test_missing_manifest_or_shard(spark, tmp_path, mnist):
    with pytest.raises(DataError, match=r"no _manifest.json"):
        read_shards(spark, str(tmp_path))
    x, y = mnist
    out = tmp_path / "s"
    write_shards(extended_mnist(spark, x[:50], y[:50], n=20, partitions=2), str(out))
    (out / "shard-00001.parquet").unlink()
    with pytest.raises(DataError, match=r"shard-00001.parquet listed in .* is missing"):
        read_shards(spark, str(out))
