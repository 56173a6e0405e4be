#!/usr/bin/env bash
# Set up .venv (once) and run the main job on the embedded default: Spark local[*], sample
# data shipped in data/. Extra arguments go to the job (see jobs/demo.py --help).
source "$(dirname "$0")/_env.sh"
for arg in "$@"; do
  case "$arg" in
    # a Spark Connect client has no JVM of its own: plain Python, not spark-submit
    --remote|--remote=*) exec python jobs/demo.py --config conf/jobs/demo.toml "$@" ;;
  esac
done
exec spark-submit --properties-file conf/spark/local.conf jobs/demo.py --config conf/jobs/demo.toml "$@"
