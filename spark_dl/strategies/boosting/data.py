"""Boosting's data: the Parquet files its keys come from (the DataFrame's own, or a copy
written once) and the keys cut from them, chunks of rows each worker reads with pyarrow."""

from __future__ import annotations

from pathlib import Path

from ..base import Job

__all__ = ["cut_keys", "parquet_files"]


def parquet_files(job: Job, data_dir: Path | str, say) -> list[str]:
    """The Parquet files the keys come from: the DataFrame's own when it is a plain Parquet
    scan (spark.read.parquet(...), nothing on top), else those of a copy of its feature and
    label columns written once to ``data_dir`` (reused when complete)."""
    df, stage = job.df, job.stage
    cols = [c for c in (stage["features"], stage["label"]) if c]
    if _plain_parquet(df):
        return sorted(df.inputFiles())
    path = str(data_dir)
    uri = path if "://" in path else Path(path).resolve().as_uri()
    done = Path(path) / "_SUCCESS" if "://" not in path else None
    if done is None or not done.exists():
        say(f"boosting: writing the DataFrame's {', '.join(cols)} columns as Parquet to "
            f"{path} (the workers read their keys from there)")
        df.select(*cols).write.mode("overwrite").parquet(uri)
    return sorted(job.spark.read.parquet(uri).inputFiles())


def _plain_parquet(df) -> bool:
    try:
        plan = df._jdf.queryExecution().optimizedPlan().toString().strip()
    except Exception:                     # Spark Connect: no JVM handle, write a copy
        return False
    return "\n" not in plan and plan.startswith("Relation") and "parquet" in plan


def cut_keys(files: list[str], key_rows: int) -> list[tuple[str, int, int]]:
    """Every file's rows in chunks of ``key_rows`` (the last of a file may be shorter):
    (file URI, first row, end row)."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq
    keys = []
    for uri in files:
        fs, path = pafs.FileSystem.from_uri(uri)
        with fs.open_input_file(path) as f:
            n = pq.ParquetFile(f).metadata.num_rows
        keys += [(uri, a, min(a + key_rows, n)) for a in range(0, n, key_rows)]
    return keys
