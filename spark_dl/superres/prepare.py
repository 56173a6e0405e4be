"""Training pairs for noise-resilient super-resolution, made in the executors (thesis ch. 5).

An image folder (PNG/JPEG, any mode) -> Parquet shards of aligned patch pairs, Y channel in
[0, 1]:

    hr        (size x size)            the clean high-resolution patch
    lr_clean  (size/s x size/s)        its bicubic downscale by the scale s
    lr        (size/s x size/s)        lr_clean degraded (noise, blur, salt-and-pepper, mixes)

Each image is also augmented by the 8 flips/rotations (``augment=True``). Spark reads the files
(``binaryFile``) and every task decodes, cuts and degrades its own images: the driver never
holds a patch. Unreadable images and images smaller than a patch are skipped and counted
(``PreparedPatches.skipped``). The Parquet folder appears only when complete: it is written
under a temporary name and renamed.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
import zlib
from collections.abc import Iterator

import numpy as np

from ..compat import default_parallelism, is_connect
from ..errors import ConfigError, DataError
from .images import bicubic, patches, rgb_to_y

__all__ = ["PATCH_SCHEMA", "Degradation", "PreparedPatches", "degrade", "dihedral", "make_pairs",
           "prepare_patches"]

PATCH_SCHEMA = "image string, hr array<float>, lr_clean array<float>, lr array<float>"
KINDS = ("gaussian", "blur", "salt_pepper", "blur+gaussian", "none")


@dataclasses.dataclass(frozen=True)
class Degradation:
    """How the low-resolution patch is corrupted. ``sigma``: Gaussian noise std on the 0-255
    scale (the thesis: 20, 25, 30); ``blur``: Gaussian blur std in pixels; ``amount``: fraction
    of salt-and-pepper pixels."""
    kind: str = "gaussian"
    sigma: float = 20.0
    blur: float = 1.0
    amount: float = 0.05

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"degradation kind {self.kind!r} is unknown; choose one of "
                              f"{', '.join(KINDS)}")
        if self.sigma < 0 or self.blur < 0 or not 0 <= self.amount <= 1:
            raise ConfigError(f"degradation values out of range: sigma {self.sigma} >= 0, "
                              f"blur {self.blur} >= 0, amount {self.amount} in [0, 1]")


def _blur(img: np.ndarray, sigma: float) -> np.ndarray:
    """Separable Gaussian blur, edges replicated (B, h, w) or (h, w)."""
    if sigma <= 0:
        return img
    r = max(1, int(round(3 * sigma)))  # noqa: RUF046 - round(np.float64) is a float in NumPy 1
    k = np.exp(-0.5 * (np.arange(-r, r + 1) / sigma) ** 2)
    k = (k / k.sum()).astype(np.float32)
    pad = [(0, 0)] * (img.ndim - 2) + [(r, r), (r, r)]
    p = np.pad(img, pad, mode="edge")
    rows = sum(k[i] * p[..., i:i + p.shape[-2] - 2 * r, :] for i in range(2 * r + 1))
    return sum(k[i] * rows[..., :, i:i + rows.shape[-1] - 2 * r] for i in range(2 * r + 1))


def degrade(lr: np.ndarray, d: Degradation, rng: np.random.Generator) -> np.ndarray:
    """The degraded copy of clean patches ``lr`` (values in [0, 1]), clipped to [0, 1]."""
    out = lr.astype(np.float32, copy=True)
    if "blur" in d.kind:
        out = _blur(out, d.blur)
    if "gaussian" in d.kind:
        out = out + rng.normal(0.0, d.sigma / 255.0, out.shape).astype(np.float32)
    if d.kind == "salt_pepper":
        hit = rng.random(out.shape) < d.amount
        out[hit] = (rng.random(int(hit.sum())) < 0.5).astype(np.float32)
    return np.clip(out, 0.0, 1.0).astype(np.float32)


def dihedral(img: np.ndarray) -> list[np.ndarray]:
    """The 8 flips/rotations of a 2-D image."""
    out = []
    for k in range(4):
        r = np.rot90(img, k)
        out += [np.ascontiguousarray(r), np.ascontiguousarray(r[:, ::-1])]
    return out


def make_pairs(y: np.ndarray, size: int, scale: int, stride: int, d: Degradation,
               rng: np.random.Generator, augment: bool = True):
    """(hr, lr_clean, lr) arrays of shapes (n, size, size), (n, size/s, size/s) x 2 from one
    Y image; n = 0 when the image is smaller than a patch."""
    if size % scale:
        raise ConfigError(f"the scale {scale} must divide the patch size {size}; use e.g. "
                          f"size {size - size % scale or scale * 8} for scale {scale}")
    views = dihedral(y) if augment else [y]
    hr = np.concatenate([patches(v, size, stride) for v in views]) if views else \
        np.zeros((0, size, size), np.float32)
    small = size // scale
    lr_clean = np.stack([bicubic(p, (small, small)) for p in hr]) if len(hr) else \
        np.zeros((0, small, small), np.float32)
    lr_clean = np.clip(lr_clean, 0.0, 1.0)
    return hr.astype(np.float32), lr_clean.astype(np.float32), degrade(lr_clean, d, rng)


@dataclasses.dataclass(frozen=True)
class PreparedPatches:
    path: str
    patches: int
    images: int
    skipped: dict            # image path -> why


def prepare_patches(spark, folder: str, out: str, size: int = 32, scale: int = 2,
                    stride: int = 16, degradation: Degradation = Degradation(),
                    augment: bool = True, seed: int = 0, partitions: int | None = None
                    ) -> PreparedPatches:
    """Write the patch pairs of every image under ``folder`` to the Parquet folder ``out``."""
    import pyarrow as pa

    from ..data.images import decode_image, image_files
    if size % scale:
        make_pairs(np.zeros((size, size), np.float32), size, scale, stride, degradation,
                   np.random.default_rng(0))                  # raises the ConfigError
    files = image_files(spark, folder)
    n_files = files.count()
    if n_files == 0:
        raise DataError(f"no images (*.png, *.jpg, ...) under {folder}")
    files = files.repartition(partitions or default_parallelism(spark))
    # why images were skipped: an accumulator; Spark Connect has none (see _skipped_images)
    skipped_acc = None if is_connect(spark) else spark.sparkContext.accumulator({}, _DictParam())

    def skip(path: str, why: str) -> None:
        if skipped_acc is not None:
            skipped_acc.add({path: why})

    def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for b in batches:
            for path, raw in zip(b.column("path").to_pylist(), b.column("content").to_pylist()):
                # a per-image seed: the same folder gives the same patches on any cluster
                rng = np.random.default_rng([seed, zlib.crc32(path.encode())])
                try:
                    y = rgb_to_y(_to_uint8(decode_image(raw, path)))
                except DataError as e:
                    skip(path, str(e))
                    continue
                hr, lr_clean, lr = make_pairs(y, size, scale, stride, degradation, rng, augment)
                if not len(hr):
                    skip(path, _too_small(y, size))
                    continue
                yield _row_batch(path, hr, lr_clean, lr)

    tmp = f"{out.rstrip('/')}.tmp-{uuid.uuid4().hex[:8]}"
    files.mapInArrow(task, PATCH_SCHEMA).write.mode("overwrite").parquet(tmp)
    skipped = dict(skipped_acc.value) if skipped_acc is not None else \
        _skipped_images(spark, files, tmp, size)
    n_patches = spark.read.parquet(tmp).count()
    meta = json.dumps({"size": size, "scale": scale, "stride": stride, "augment": augment,
                       "seed": seed, "degradation": dataclasses.asdict(degradation),
                       "patches": n_patches, "images": n_files, "skipped": skipped}, indent=1)
    if is_connect(spark):
        _publish_arrow(tmp, out, meta)
    else:
        _publish_hadoop(spark, tmp, out, meta)
    return PreparedPatches(out, n_patches, n_files, skipped)


def _too_small(y: np.ndarray, size: int) -> str:
    return f"{y.shape[1]}x{y.shape[0]} pixels, smaller than a {size}x{size} patch"


def _skipped_images(spark, files, tmp: str, size: int) -> dict:
    """{image: why} for the images that gave no patch, without an accumulator: the images
    missing from the written patches, decoded again on the driver (only those)."""
    from pyspark.sql import functions as F

    from ..data.images import decode_image
    have = [r.image for r in spark.read.parquet(tmp).select("image").distinct().collect()]
    skipped = {}
    for r in files.where(~F.col("path").isin(have)).select("path", "content").collect():
        try:
            skipped[r.path] = _too_small(rgb_to_y(_to_uint8(decode_image(r.content, r.path))),
                                         size)
        except DataError as e:
            skipped[r.path] = str(e)
    return skipped


def _publish_arrow(tmp: str, out: str, meta: str) -> None:
    """_publish_hadoop through pyarrow's file systems (local, S3, GCS, HDFS), for Spark
    Connect clients, which have no JVM."""
    from pyarrow import fs as pafs
    filesystem, dest = pafs.FileSystem.from_uri(_uri(out))
    _, src = pafs.FileSystem.from_uri(_uri(tmp))
    if filesystem.get_file_info(dest).type != pafs.FileType.NotFound:
        filesystem.delete_dir(dest)
    filesystem.move(src, dest)
    with filesystem.open_output_stream(f"{dest.rstrip('/')}/_spark_dl.json") as f:
        f.write(meta.encode())


def _uri(path: str) -> str:
    from pathlib import Path
    return path if "://" in path else Path(path).resolve().as_uri()


def _publish_hadoop(spark, tmp: str, out: str, meta: str) -> None:
    """The complete patches under ``tmp`` become ``out`` (a rename on the output's own file
    system: visible only when complete), with their description in ``_spark_dl.json``."""
    jvm, conf = spark.sparkContext._jvm, spark.sparkContext._jsc.hadoopConfiguration()
    dest, tmp_path = jvm.org.apache.hadoop.fs.Path(out), jvm.org.apache.hadoop.fs.Path(tmp)
    fs = dest.getFileSystem(conf)
    if fs.exists(dest):
        fs.delete(dest, True)
    if not fs.rename(tmp_path, dest):
        raise DataError(f"could not rename {tmp} to {out}; the patches are complete under the "
                        f"first name")
    stream = fs.create(jvm.org.apache.hadoop.fs.Path(f"{out.rstrip('/')}/_spark_dl.json"), True)
    stream.write(bytearray(meta.encode()))
    stream.close()


def _to_uint8(img: np.ndarray) -> np.ndarray:
    return img if img.dtype == np.uint8 else \
        np.clip(img.astype(np.float64) / (257.0 if img.max() > 255 else 1.0), 0, 255) \
        .astype(np.uint8)


def _row_batch(path: str, hr: np.ndarray, lr_clean: np.ndarray, lr: np.ndarray):
    import pyarrow as pa
    n = len(hr)

    def col(a):                          # (n, h, w) -> list<float> rows without copies
        flat = pa.array(a.reshape(-1), pa.float32())
        return pa.ListArray.from_arrays(pa.array(np.arange(n + 1) * a[0].size, pa.int32()), flat)
    return pa.RecordBatch.from_arrays([pa.array([path] * n), col(hr), col(lr_clean), col(lr)],
                                      schema=_arrow_schema())


class _DictParam:
    """Accumulator of {image: why it was skipped}."""

    def zero(self, value):
        return {}

    def addInPlace(self, a, b):
        a.update(b)
        return a


def _arrow_schema():
    import pyarrow as pa
    f = pa.list_(pa.float32())
    return pa.schema([("image", pa.string()), ("hr", f), ("lr_clean", f), ("lr", f)])
