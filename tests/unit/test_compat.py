"""spark_dl.compat's version gate and the refusals it words, on the installed pyspark."""

from __future__ import annotations

import importlib.util

import pyspark
import pytest

from spark_dl import compat, session
from spark_dl.errors import ConfigError, SparkDLError


@pytest.mark.compat
def test_the_version_is_the_installed_pyspark_and_gates_by_major_and_minor(monkeypatch):
    assert compat.SPARK_VERSION[:2] == tuple(int(v) for v in pyspark.__version__.split(".")[:2])
    assert compat._version("3.5.7") == (3, 5, 7) and compat._version("4.1.0.dev2") == (4, 1, 0)
    assert compat._version("4.0") == (4, 0, 0)
    compat.require_spark("anything", (3, 5))                      # 3.5 and 4.x: passes
    monkeypatch.setattr(compat, "SPARK_VERSION", (3, 5, 7))
    with pytest.raises(SparkDLError, match=r"^saving X needs Spark 4\.0 or newer; this is "
                                           rf"pyspark {pyspark.__version__}$"):
        compat.require_spark("saving X")


@pytest.mark.compat
@pytest.mark.skipif(importlib.util.find_spec("grpc_status") is None,
                    reason="pyspark[connect] is not installed")
def test_a_local_connect_server_before_spark_4_is_refused_with_the_fix(monkeypatch):
    """pyspark 3.5 ships no Spark Connect server: remote='local[N]' is refused before any
    JVM starts, naming the Maven package that adds it and the running-server alternative."""
    monkeypatch.setattr(session, "SPARK_VERSION", (3, 5, 7))    # what pyspark 3.5 reports
    with pytest.raises(ConfigError, match=r"remote='local\[2\]' starts pyspark's own Spark "
                                          r"Connect server, which needs Spark 4\.0 or newer; "
                                          rf"this is pyspark {pyspark.__version__}.*"
                                          r"remote='sc://host:15002'.*spark\.jars\.packages"):
        session.get_session("local", remote="local[2]")
