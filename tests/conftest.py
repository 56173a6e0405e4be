"""Shared fixtures: one real Spark session (local[2]) for the whole test session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MNIST_IMAGES = ROOT / "data" / "mnist" / "t10k-images-idx3-ubyte.gz"
MNIST_LABELS = ROOT / "data" / "mnist" / "t10k-labels-idx1-ubyte.gz"

# Executors' Python workers must run this interpreter (it has torch and spark_dl).
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "conf" / "logging"))


@pytest.fixture(scope="session")
def spark():
    from spark_dl.session import get_session
    session = get_session("local", master="local[2]",
                          conf={"spark.sql.shuffle.partitions": "2",
                                "spark.default.parallelism": "2"})
    yield session
    session.stop()


@pytest.fixture(scope="session")
def mnist():
    """(images (10000, 28, 28) uint8, labels (10000,) int64) of the shipped MNIST test split."""
    from spark_dl.data import load_mnist
    return load_mnist(MNIST_IMAGES, MNIST_LABELS)


@pytest.fixture(scope="session")
def venv_bin() -> Path:
    return Path(sys.executable).parent
