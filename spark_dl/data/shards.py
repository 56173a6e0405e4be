"""Parquet shards written and read through pyarrow, one file per Spark partition.

``write_shards`` runs in the executors: each task streams its partition's Arrow batches into
``shard-<partition>.parquet`` under the target directory (any pyarrow filesystem URI: ``hdfs://``,
``s3://``, or a local path, made absolute on the driver, that every executor can reach). The driver receives only a summary
per shard and writes ``_manifest.json`` (schema, shards, row counts), which ``read_shards``
checks before handing the directory to Spark.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pyarrow as pa

from ..errors import DataError

__all__ = ["MANIFEST", "read_shards", "shard_files", "write_shards"]

MANIFEST = "_manifest.json"


def _resolve(uri: str) -> str:
    """Driver side: a plain path becomes an absolute ``file://`` URI, so that executors (whose
    working directories differ from the driver's) and Spark's reader (whose default
    filesystem may be HDFS) all see the same place."""
    return uri if "://" in uri else "file://" + os.path.abspath(uri)


def _fs(uri: str):
    from pyarrow import fs
    return fs.FileSystem.from_uri(_resolve(uri))


def write_shards(df, uri: str, mode: str = "error", compression: str = "snappy") -> dict:
    """Write ``df`` as Parquet shards; ``mode`` is "error" (refuse an existing dir) or
    "overwrite". Returns the manifest. Empty partitions write no file."""
    if mode not in ("error", "overwrite"):
        raise ValueError(f"mode must be 'error' or 'overwrite', got {mode!r}")
    from pyarrow import fs as pafs
    uri = _resolve(uri)
    filesystem, root = _fs(uri)
    info = filesystem.get_file_info(root)
    if info.type != pafs.FileType.NotFound:
        if mode == "error":
            raise DataError(f"shard directory {uri} already exists; pass mode='overwrite' or "
                            f"choose another path")
        listing = filesystem.get_file_info(pafs.FileSelector(root, allow_not_found=True)) \
            if info.type == pafs.FileType.Directory else [info]
        if info.type != pafs.FileType.Directory or (
                listing and not any(f.base_name == MANIFEST for f in listing)):
            raise DataError(f"refusing to overwrite {uri}: it is not a shard directory written "
                            f"by write_shards (no {MANIFEST}); remove it yourself or choose "
                            f"another path")
        filesystem.delete_dir(root)
    filesystem.create_dir(root, recursive=True)

    def _write_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        # Runs on executors: stream this partition into its own Parquet file.
        import pyarrow.parquet as pq
        from pyspark import TaskContext
        ctx = TaskContext.get()
        part = ctx.partitionId()
        filesystem_, root_ = _fs(uri)
        name = f"shard-{part:05d}.parquet"
        # Each attempt writes its own temporary file and renames it when complete, so a
        # retried or speculative attempt never interleaves with another one's bytes.
        tmp = f"{root_}/.{name}.attempt-{ctx.taskAttemptId()}"
        writer, rows = None, 0
        try:
            for b in batches:
                if b.num_rows == 0:
                    continue
                if writer is None:
                    sink = filesystem_.open_output_stream(tmp)
                    writer = pq.ParquetWriter(sink, b.schema, compression=compression)
                writer.write_batch(b)
                rows += b.num_rows
        finally:
            if writer is not None:
                writer.close()
                sink.close()
        if rows:
            filesystem_.move(tmp, f"{root_}/{name}")
        yield pa.RecordBatch.from_arrays(
            [pa.array([name if rows else None], pa.string()), pa.array([rows], pa.int64()),
             pa.array([part], pa.int32())], ["shard", "rows", "partition"])

    summary = df.mapInArrow(_write_task, "shard string, rows long, partition int").collect()
    shards = sorted((r.shard, r.rows) for r in summary if r.rows)
    manifest = {"format": "spark_dl.shards/1", "schema": df.schema.json(),
                "rows": sum(n for _, n in shards),
                "shards": [{"file": f, "rows": n} for f, n in shards]}
    with filesystem.open_output_stream(f"{root}/{MANIFEST}") as out:
        out.write(json.dumps(manifest, indent=1).encode())
    return manifest


def _manifest(uri: str) -> dict:
    filesystem, root = _fs(uri)
    try:
        with filesystem.open_input_stream(f"{root}/{MANIFEST}") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        raise DataError(f"{uri} has no {MANIFEST}: not a shard directory written by "
                        f"write_shards (or the write did not finish); rewrite it") from None


def shard_files(uri: str) -> list[tuple[str, int]]:
    """(path, rows) of each shard, checked to exist."""
    filesystem, root = _fs(uri)
    out = []
    for s in _manifest(uri)["shards"]:
        path = f"{root}/{s['file']}"
        if filesystem.get_file_info(path).type.name == "NotFound":
            raise DataError(f"shard {s['file']} listed in {uri}/{MANIFEST} is missing; "
                            f"rewrite the shards")
        out.append((f"{_resolve(uri).rstrip('/')}/{s['file']}", s["rows"]))
    return out


def read_shards(spark, uri: str):
    """The shards as a DataFrame (one input split per shard file for typical shard sizes)."""
    from pyspark.sql.types import StructType
    manifest = _manifest(uri)
    files = [p for p, _ in shard_files(uri)]
    schema = StructType.fromJson(json.loads(manifest["schema"]))
    if not files:
        return spark.createDataFrame([], schema)
    return spark.read.schema(schema).parquet(*files)
