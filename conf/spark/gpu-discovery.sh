#!/usr/bin/env bash
# Spark resource discovery script for GPUs: prints {"name":"gpu","addresses":["0","1",...]}.
# SPARK_DL_FAKE_GPUS="0,1" fakes addresses so GPU scheduling can be tested without a GPU.
if [ -n "${SPARK_DL_FAKE_GPUS:-}" ]; then
  ids="$SPARK_DL_FAKE_GPUS"
elif command -v nvidia-smi >/dev/null 2>&1; then
  ids=$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, -)
else
  ids=""
fi
addrs=$(printf '%s' "$ids" | tr -d ' ' | sed -e 's/[^,][^,]*/"&"/g')
printf '{"name": "gpu", "addresses": [%s]}\n' "$addrs"
