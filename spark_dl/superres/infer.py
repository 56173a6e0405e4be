"""Super-resolution of a folder of images as a Spark job.

Spark reads the files (``binaryFile``); each task decodes its images, runs the trained cascade
on the Y channel (tiles of the LR patch size with overlap through the SSDA, stitched; the
bicubic upscale and the fully-convolutional CNN on the whole image), upscales Cb and Cr
bicubically, and writes ``<name>.png`` in colour (grayscale stays grayscale) to ``out_dir``,
which the executors must be able to write (a shared or local filesystem). The network is built
once per Python worker and reused by the tasks that worker runs. Unreadable images are reported,
not fatal. Returns one row per image: path, output, size, seconds, error.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..compat import default_parallelism

__all__ = ["super_resolve_folder"]

_CACHE: dict = {}                       # per Python worker: model bytes digest -> (ssda, cnn)


def _models(blob: bytes):
    key = hashlib.sha256(blob).hexdigest()
    if key not in _CACHE:
        import torch
        torch.set_num_threads(1)
        # the driver's own pickle of the model, shipped in the task closure (not network input)
        model = torch.load(io.BytesIO(blob), weights_only=False)
        model.eval()
        _CACHE.clear()
        _CACHE[key] = model
    return _CACHE[key]


def _chroma(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 RGB -> Cb, Cr in [0, 1] (ITU-R BT.601 studio range; Y is images.rgb_to_y)."""
    r, g, b = (rgb[..., i].astype(np.float64) / 255.0 for i in range(3))
    cb = (128 - 37.797 * r - 74.203 * g + 112.0 * b) / 255
    cr = (128 + 112.0 * r - 93.786 * g - 18.214 * b) / 255
    return cb.astype(np.float32), cr.astype(np.float32)


def _rgb(y: np.ndarray, cb: np.ndarray, cr: np.ndarray) -> np.ndarray:
    y, cb, cr = (a.astype(np.float64) * 255 for a in (y, cb, cr))
    r = 1.164383 * (y - 16) + 1.596027 * (cr - 128)
    g = 1.164383 * (y - 16) - 0.391762 * (cb - 128) - 0.812968 * (cr - 128)
    b = 1.164383 * (y - 16) + 2.017232 * (cb - 128)
    return np.clip(np.stack([r, g, b], -1), 0, 255).round().astype(np.uint8)


def super_resolve_folder(spark, model, folder: str, out_dir: str, scale: int = 2,
                         lr_size: int = 16, stride: int = 8, partitions: int | None = None,
                         ensemble: bool = False):
    """Run ``model`` (a superres.cascade.Cascade) over every image under ``folder``;
    ``ensemble``: average over the 8 flips/rotations (tiles.self_ensemble, 8x the work)."""
    import pyarrow as pa
    import torch

    from ..data.images import image_files
    buf = io.BytesIO()
    torch.save(model, buf)
    blob = buf.getvalue()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    files = image_files(spark, folder).repartition(
        partitions or default_parallelism(spark))
    schema = pa.schema([("path", pa.string()), ("output", pa.string()), ("width", pa.int32()),
                        ("height", pa.int32()), ("seconds", pa.float64()),
                        ("error", pa.string())])

    def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import time

        from PIL import Image

        from spark_dl.data.images import decode_image
        from spark_dl.errors import DataError
        from spark_dl.superres.images import bicubic, rgb_to_y
        from spark_dl.superres.tiles import super_resolve
        net = _models(blob)
        rows = {k: [] for k in schema.names}
        for b in batches:
            for path, raw in zip(b.column("path").to_pylist(), b.column("content").to_pylist()):
                t0 = time.perf_counter()
                out = str(Path(out_dir) / (Path(path).stem + ".png"))
                try:
                    img = decode_image(raw, path)
                    size = (img.shape[0] * scale, img.shape[1] * scale)
                    y = img.astype(np.float32) / 255 if img.ndim == 2 else rgb_to_y(img)
                    sr = super_resolve(y, scale, net.ssda, net.cnn, lr_size, stride, ensemble)
                    if img.ndim == 2:
                        pic = Image.fromarray((sr * 255).round().astype(np.uint8))
                    else:
                        cb, cr = _chroma(img)
                        pic = Image.fromarray(_rgb(sr, np.clip(bicubic(cb, size), 0, 1),
                                                   np.clip(bicubic(cr, size), 0, 1)))
                    tmp = out + ".tmp"
                    pic.save(tmp, format="PNG")
                    Path(tmp).replace(out)                  # no half-written PNG
                    err = None
                except (DataError, ValueError) as e:
                    out, size, err = None, (0, 0), str(e)
                rows["path"].append(path)
                rows["output"].append(out)
                rows["width"].append(size[1])
                rows["height"].append(size[0])
                rows["seconds"].append(time.perf_counter() - t0)
                rows["error"].append(err)
        yield pa.RecordBatch.from_pydict(rows, schema=schema)

    ddl = "path string, output string, width int, height int, seconds double, error string"
    return files.mapInArrow(task, ddl).collect()
