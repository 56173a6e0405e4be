"""Image folders -> DataFrames of decoded images (Pillow, in the executors).

Rows: ``path`` string, ``height``/``width``/``channels`` int, ``mode`` string ("L" or "RGB"),
``data`` binary (uint8, row-major H×W×C) and ``error`` string (null for good images).

Corrupt files: ``on_error="raise"`` (default) fails the job with a DataError naming the file;
``"skip"`` drops them; ``"keep"`` keeps them as rows with null data and the reason in
``error``, so ``df.filter("error is not null").count()`` counts them.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from ..errors import DataError

__all__ = ["IMAGE_EXTENSIONS", "IMAGE_SCHEMA", "decode_image", "image_files", "read_images"]

IMAGE_SCHEMA = ("path string, height int, width int, channels int, mode string, "
                "data binary, error string")
IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "bmp", "tif", "tiff")


def decode_image(raw: bytes, path: str = "<bytes>") -> np.ndarray:
    """bytes -> uint8 (H, W) for grayscale or (H, W, 3) for everything else."""
    from PIL import Image, UnidentifiedImageError
    try:
        with Image.open(io.BytesIO(raw)) as im:
            im.load()
            im = im if im.mode in ("L", "RGB") else im.convert("RGB")
            return np.asarray(im)
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError,
            SyntaxError) as e:
        raise DataError(f"corrupt or unreadable image {path}: {e}; remove or replace the file, "
                        f"or read with on_error='skip'") from e


def image_files(spark, folder: str, recursive: bool = True, extensions=IMAGE_EXTENSIONS):
    """The image files under ``folder`` as a DataFrame (path, content), read by Spark."""
    from pyspark.errors import AnalysisException
    pattern = "*.{" + ",".join(sorted({e.lower() for e in extensions} |
                                      {e.upper() for e in extensions})) + "}"
    try:
        return (spark.read.format("binaryFile").option("pathGlobFilter", pattern)
                .option("recursiveFileLookup", str(recursive).lower()).load(folder)
                .select("path", "content"))
    except AnalysisException as e:   # the folder does not exist
        raise DataError(f"cannot list images in {folder}: {e}") from e


def read_images(spark, folder: str, on_error: str = "raise", recursive: bool = True,
                extensions=IMAGE_EXTENSIONS):
    """Decode every image file under ``folder`` (see module docstring for ``on_error``)."""
    if on_error not in ("raise", "skip", "keep"):
        raise ValueError(f"on_error must be 'raise', 'skip' or 'keep', got {on_error!r}")
    files = image_files(spark, folder, recursive, extensions)

    def _decode_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        # Runs on executors: decode each file with Pillow.
        for b in batches:
            out = {k: [] for k in ("path", "height", "width", "channels", "mode", "data",
                                   "error")}
            for path, raw in zip(b.column(0).to_pylist(), b.column(1).to_pylist()):
                try:
                    img = decode_image(raw, path)
                except DataError as e:
                    if on_error == "raise":
                        raise
                    if on_error == "skip":
                        continue
                    img, err = None, str(e)
                else:
                    err = None
                h, w, c = (img.shape + (1,))[:3] if img is not None else (None, None, None)
                out["path"].append(path)
                out["height"].append(h)
                out["width"].append(w)
                out["channels"].append(c)
                out["mode"].append(None if img is None else ("L" if c == 1 else "RGB"))
                out["data"].append(None if img is None else img.tobytes())
                out["error"].append(err)
            yield pa.RecordBatch.from_pydict(out, schema=_arrow_schema())

    return files.mapInArrow(_decode_task, IMAGE_SCHEMA)


def _arrow_schema() -> pa.Schema:
    return pa.schema([("path", pa.string()), ("height", pa.int32()), ("width", pa.int32()),
                      ("channels", pa.int32()), ("mode", pa.string()), ("data", pa.binary()),
                      ("error", pa.string())])
