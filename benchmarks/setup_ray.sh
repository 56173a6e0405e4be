#!/usr/bin/env bash
# The Ray Train peer for bench_run.py: Ray (train + default extras, for Ray-on-Spark's
# ray.util.spark.setup_ray_cluster) in its own virtual environment (.venv-ray) beside the
# same torch CPU build and pyspark as .venv, plus spark_dl itself (the peer reads the same
# DataFrame shards and builds the same thesis CNN). Re-running when it is there does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-ray
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import ray.train.torch, ray.util.spark, torch, pyspark, spark_dl" 2>/dev/null; then
    exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "torch==2.13.0"
"$VENV/bin/pip" install -q "ray[train,default]==2.60.*" "pyspark==4.3.*" "pyarrow" "pandas<3" "pillow"
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" -c "import ray, torch, pyspark; print('ray ready:', ray.__version__, 'torch', torch.__version__, 'pyspark', pyspark.__version__)"
