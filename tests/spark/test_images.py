import numpy as np
import pytest
from PIL import Image
from pyspark.errors import PythonException

from spark_dl.data import read_images
from spark_dl.errors import DataError


@pytest.fixture
def folder(tmp_path):
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (7, 5, 3), np.uint8)).save(tmp_path / "a.png")
    Image.fromarray(rng.integers(0, 255, (4, 6), np.uint8)).save(tmp_path / "b.jpg", quality=95)
    (tmp_path / "sub").mkdir()
    Image.fromarray(rng.integers(0, 255, (3, 3, 4), np.uint8)).save(tmp_path / "sub" / "c.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    (tmp_path / "notes.txt").write_text("ignored: not an image extension")
    return tmp_path


def test_corrupt_image_raises_naming_the_file(spark, folder):
    with pytest.raises(PythonException, match=r"corrupt or unreadable image .*broken.png"):
        read_images(spark, str(folder)).collect()


def test_skip_and_keep(spark, folder):
    good = {r.path.rsplit("/", 1)[1]: r for r in read_images(spark, str(folder), "skip").collect()}
    assert set(good) == {"a.png", "b.jpg", "c.png"}
    a = good["a.png"]
    assert (a.height, a.width, a.channels, a.mode) == (7, 5, 3, "RGB")
    np.testing.assert_array_equal(
        np.frombuffer(a.data, np.uint8).reshape(7, 5, 3), np.asarray(Image.open(folder / "a.png")))
    assert (good["b.jpg"].channels, good["b.jpg"].mode) == (1, "L")
    assert good["c.png"].channels == 3                          # RGBA converted to RGB
    kept = read_images(spark, str(folder), "keep")
    bad = kept.filter("error is not null").collect()
    assert len(bad) == 1 and bad[0].path.endswith("broken.png") and bad[0].data is None
    assert kept.count() == 4


def test_missing_folder(spark, tmp_path):
    with pytest.raises(DataError, match="cannot list images"):
        read_images(spark, str(tmp_path / "none"))
    with pytest.raises(ValueError, match="on_error"):
        read_images(spark, str(tmp_path), on_error="ignore")
