# Sourced by scripts/demo.sh, scripts/test.sh and scripts/compat.sh: create or reuse a venv.
# The first run installs the CPU torch pin, then spark_dl with its test extras (a few minutes);
# later runs compare a stamp of the package metadata and skip pip entirely (well under a second).
# SPARK_DL_VENV names the venv (default .venv, pyspark 4.x); SPARK_DL_PINS adds requirements
# to its install (scripts/compat.sh: .venv-35 with pyspark 3.5).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/${SPARK_DL_VENV:-.venv}"
PINS="${SPARK_DL_PINS:-}"
PYTHON_BIN="${PYTHON:-python3}"

command -v java >/dev/null 2>&1 || {
  echo "error: 'java' not found on PATH; Spark needs Java 17 (e.g. apt-get install openjdk-17-jre-headless)" >&2
  exit 1
}
java_major="$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n 1)"
if [ "${java_major:-0}" -lt 17 ]; then
  echo "error: Spark 4 needs Java 17 or newer; 'java -version' reports ${java_major:-unknown}" >&2
  exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "setting up $VENV (first run: installs torch==2.13.0, pyspark${PINS:+ ($PINS)} and test tools) ..." >&2
  "$PYTHON_BIN" -m venv "$VENV"
fi
stamp="$VENV/.spark_dl-stamp"
want="$( (cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml"; echo "$PINS") | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  log="$VENV/install.log"
  {
    # CPU wheel first: an unpinned torch would pull gigabytes of CUDA packages.
    "$VENV/bin/pip" install torch==2.13.0 &&
    read -r -a pins <<<"$PINS" &&   # requirements split on spaces, not glob-expanded
    "$VENV/bin/pip" install -e "$ROOT[test]" "${pins[@]}"
  } >"$log" 2>&1 || { tail -n 40 "$log" >&2; echo "error: installation failed; full log in $log" >&2; exit 1; }
  echo "$want" >"$stamp"
fi
# Executors' Python workers must run this interpreter, or tasks fail with "No module named 'torch'".
export PYSPARK_PYTHON="$VENV/bin/python"
export PYSPARK_DRIVER_PYTHON="$VENV/bin/python"
export SPARK_CONF_DIR="${SPARK_CONF_DIR:-$ROOT/conf/logging}"   # quiet log4j2 settings
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
