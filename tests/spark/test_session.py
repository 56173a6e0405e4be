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


def test_a_plain_python_driver_gives_executors_its_interpreter(tmp_path):
    """Without PYSPARK_PYTHON, executors would start the system python3 (no torch)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                  if not p.startswith(sys.prefix))
    code = ("from spark_dl import get_session\n"
            "s = get_session(master='local[1]')\n"
            "print(s.sparkContext.parallelize([0], 1)"
            ".map(lambda _: __import__('torch').__version__).collect())\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import torch
    assert repr([torch.__version__]) in proc.stdout
