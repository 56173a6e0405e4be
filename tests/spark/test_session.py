import pytest

from spark_dl import get_session


def test_session_is_reused_and_has_arrow_and_the_drivers_python(spark):
    import sys
    with pytest.warns(UserWarning, match="already running in this driver; reusing it"):
        again = get_session("local")
    assert again is spark                             # one session per driver, reused
    conf = spark.sparkContext.getConf()
    assert conf.get("spark.sql.execution.arrow.pyspark.enabled") == "true"
    assert conf.get("spark.pyspark.python") == sys.executable
    assert spark.sparkContext.master == "local[2]"


def test_executors_run_torch(spark):
    def _task(it):
        import torch
        yield float(torch.ones(3).sum())
    assert spark.sparkContext.parallelize(range(2), 2).mapPartitions(_task).collect() == [3.0, 3.0]


# A plain Python driver (no PYSPARK_PYTHON, the venv not on PATH) gives the executors its
# interpreter: tests/spark/test_ml.py's fresh driver process runs that way (one JVM start).
