#!/usr/bin/env bash
# The compat tier: the tests marked "compat" (every strategy, spark_dl.run, the ML estimator
# with save/load, streamed data, bad input) on pyspark 3.5, in .venv-35 (set up once, beside
# .venv: torch==2.13.0, pyspark 3.5.7 and spark_dl's test extras). scripts/test.sh runs it
# after the default tier; extra arguments go to pytest.
#
# pyspark 3.5's extras ask for numpy<2, and pyarrow 26 needs NumPy 2 without saying so: the
# venv keeps pyarrow<26.
SPARK_DL_VENV=.venv-35
SPARK_DL_PINS="pyspark[connect]==3.5.7 pyarrow<26"
source "$(dirname "$0")/_env.sh"
exec python -m pytest -m compat -p no:cacheprovider "$@"
