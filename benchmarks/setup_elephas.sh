#!/usr/bin/env bash
# The peer for bench_downpour.py --elephas: Elephas 7.3 in its own virtual environment
# (.venv-elephas), installed with --no-deps beside tensorflow-cpu and pyspark 4.1, because
# its declared pins (pyspark<=4.0, numpy<2, tensorflow<2.20) conflict with ours.
# Re-running when it is there does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-elephas
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import elephas, tensorflow, pyspark" 2>/dev/null; then
    exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "tensorflow-cpu" "pyspark==4.1.*" "h5py" "flask" "pandas" "pyarrow"
"$VENV/bin/pip" install -q --no-deps "elephas==7.3.0"
"$VENV/bin/python" -c "import elephas, tensorflow as tf, pyspark; print('elephas ready: tensorflow', tf.__version__, 'pyspark', pyspark.__version__)"
