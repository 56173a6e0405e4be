"""Shared fixtures: one real Spark session (local[2]) for the whole test session."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MNIST_IMAGES = ROOT / "data" / "mnist" / "t10k-images-idx3-ubyte.gz"
MNIST_LABELS = ROOT / "data" / "mnist" / "t10k-labels-idx1-ubyte.gz"

# Executors' Python workers must run this interpreter (it has torch and spark_dl).
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_CONF_DIR", str(ROOT / "conf" / "logging"))
# Every JVM the tests start through spark-submit (this session's, the notebooks' kernels', the
# Connect server's, the jobs') compiles with C1 only: the suite's JVMs do little steady work,
# and C2's compilations cost CPU the tests need (test_downpour + test_ml: 174 -> 161 s).
os.environ.setdefault("SPARK_SUBMIT_OPTS", "-XX:TieredStopAtLevel=1")


# The default run (scripts/test.sh, what CI runs: the default tier, then the compat tier on
# pyspark 3.5) must finish within this budget on a 2-core machine; the long tier (marker
# "long", scripts/test.sh --all) is not counted in it. scripts/test.sh sets
# SPARK_DL_TEST_STARTED, so that the compat tier's figure is the two tiers' time.
BUDGET_MIN = 20
_STARTED = float(os.environ.get("SPARK_DL_TEST_STARTED") or time.time())


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true", default=False,
                     help="also run the long tier (tests marked 'long': chaos, memory, "
                          "packaging and standalone-cluster runs, about 25 minutes more)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--all"):
        return
    skip = pytest.mark.skip(reason="long tier: run scripts/test.sh --all")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    minutes = (time.time() - _STARTED) / 60
    tier = "all tiers" if config.getoption("--all") else "default tier"
    if config.getoption("markexpr") == "compat":
        import pyspark
        tier = (f"compat tier on pyspark {pyspark.__version__}" if "SPARK_DL_TEST_STARTED"
                not in os.environ else f"default tier, then compat tier on pyspark "
                f"{pyspark.__version__}")
    verdict = "within" if minutes <= BUDGET_MIN else "OVER"
    terminalreporter.write_line(f"test time: {minutes:.1f} min ({tier}); the default tier's "
                                f"budget is {BUDGET_MIN} min on a 2-core machine: {verdict}")


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
