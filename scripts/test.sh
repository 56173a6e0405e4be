#!/usr/bin/env bash
# Set up .venv (once) and run the default tier on pyspark 4.x, then the compat tier on pyspark
# 3.5 (scripts/compat.sh, its own .venv-35). Extra arguments go to the default tier's pytest,
# e.g. scripts/test.sh -m "not slow" for the fast tier only; SPARK_DL_COMPAT=0 leaves the
# compat tier out. The exit status is the first failing tier's.
source "$(dirname "$0")/_env.sh"
export SPARK_DL_TEST_STARTED="${SPARK_DL_TEST_STARTED:-$(date +%s)}"  # one budget for both
status=0
python -m pytest "$@" || status=$?
if [ "${SPARK_DL_COMPAT:-1}" != 0 ]; then
  compat=0
  "$ROOT/scripts/compat.sh" || compat=$?
  [ "$status" != 0 ] || status=$compat
fi
exit "$status"
