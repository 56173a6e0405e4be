#!/usr/bin/env bash
# Start or stop a real Spark standalone cluster on 127.0.0.1: one master and 2 workers (1 core,
# 1 GiB each), run from the pip package's bin/spark-class.
#
#   scripts/standalone-cluster.sh start     # prints the master URL when both workers registered
#   scripts/standalone-cluster.sh stop
#
# SPARK_DL_MASTER_PORT (default 7077) and SPARK_DL_CLUSTER_DIR (default .standalone/) pick the
# port and the folder for logs, pids and worker work dirs. Uses .venv's pyspark (sets it up).
set -euo pipefail
cmd="${1:-}"
source "$(dirname "$0")/_env.sh"
PORT="${SPARK_DL_MASTER_PORT:-7077}"
STATE="${SPARK_DL_CLUSTER_DIR:-$ROOT/.standalone}"
SPARK_HOME="$(python -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')"
export SPARK_HOME SPARK_LOCAL_IP=127.0.0.1 SPARK_LOG_DIR="$STATE" SPARK_NO_DAEMONIZE=1
unset SPARK_CONF_DIR   # the daemons log at INFO: registration is read from the master log
URL="spark://127.0.0.1:$PORT"

stop() {
  for f in "$STATE"/*.pid; do
    [ -e "$f" ] || continue
    pid="$(cat "$f")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$f"
  done
}

wait_for() {   # wait_for <seconds> <description> <command...>: poll a condition, fail clearly
  local limit="$1" what="$2"; shift 2
  for _ in $(seq $((limit * 5))); do "$@" && return 0; sleep 0.2; done
  echo "error: $what within ${limit}s; logs in $STATE" >&2
  tail -n 20 "$STATE"/*.log >&2 || true
  stop
  exit 1
}

registered() { [ "$(grep -c 'Registering worker' "$STATE/master.log" 2>/dev/null)" -ge 2 ]; }
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; }

case "$cmd" in
  start)
    stop
    mkdir -p "$STATE"
    "$SPARK_HOME/bin/spark-class" org.apache.spark.deploy.master.Master \
      --host 127.0.0.1 --port "$PORT" --webui-port 0 >"$STATE/master.log" 2>&1 &
    echo $! >"$STATE/master.pid"
    wait_for 60 "the master did not listen on 127.0.0.1:$PORT" listening
    for i in 1 2; do
      "$SPARK_HOME/bin/spark-class" org.apache.spark.deploy.worker.Worker \
        --host 127.0.0.1 --cores 1 --memory 1g --webui-port 0 \
        --work-dir "$STATE/work-$i" "$URL" >"$STATE/worker-$i.log" 2>&1 &
      echo $! >"$STATE/worker-$i.pid"
    done
    wait_for 90 "2 workers did not register with the master" registered
    echo "$URL"
    ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
