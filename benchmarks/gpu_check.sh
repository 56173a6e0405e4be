#!/usr/bin/env bash
# The GPU issue's checks on a GPU machine, into benchmarks/results/gpu.json (and the 16-core
# scaling case into benchmarks/results/scaling-16.json). Run from the project root of a machine
# with torch + CUDA and pyspark importable (a GPU machine without Java or pyspark: unpack
# ../shared/tools/offline-bundle.sh's archive into /tmp first, and this script finds it).
#
#   bash benchmarks/gpu_check.sh [SECTIONS=one,amp,shared,lstm] [RESULTS=benchmarks/results]
#   SCALING=1 bash benchmarks/gpu_check.sh ""     # only bench_scaling at 1 and 16 replicas
#   RUN=1 bash benchmarks/gpu_check.sh ""         # only bench_run (your own loop) at 16
#   STEP_COST=1 bash benchmarks/gpu_check.sh ""   # only ddp_step_cost at 16 processes
#   PS_CAPACITY=1 bash benchmarks/gpu_check.sh "" # only bench_ps_capacity, 1 and 16 clients
#   PS_SERVING=1 bash benchmarks/gpu_check.sh ""  # only bench_ps_serving (LOOP_FROM's evidence)
# Settings from the environment: REPEATS, CORES, LSTM_SECONDS, LSTM_CONFIGS, AMP_NETS, APPEND;
# SCALING_REPLICAS (1,CORES), SCALING_STRATEGIES, SCALING_EPOCHS, SCALING_REPEATS,
# SCALING_FIRST_SEED, SCALING_LR (one replica's lr; bench_scaling's 0.02 unless set),
# SCALING_OUT (a file name in RESULTS); RUN_REPEATS, RUN_ROWS, RUN_EPOCHS;
# STEP_COST_MODES, STEP_COST_REPEATS, STEP_COST_STEPS; PS_CAPACITY_REPEATS, PS_CAPACITY_PUSHES;
# PS_SERVING_WORKERS, PS_SERVING_REPEATS.
set -uo pipefail
SECTIONS=${1-one,amp,shared,lstm}
RESULTS=${2:-benchmarks/results}
if [ -d /tmp/bundle/jre17 ] && ! python3 -c 'import pyspark' 2>/dev/null; then
  export JAVA_HOME=/tmp/bundle/jre17 PATH=/tmp/bundle/jre17/bin:$PATH \
         PYTHONPATH=/tmp/bundle/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYSPARK_PYTHON=python3
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
rc=0
if [ -n "$SECTIONS" ]; then
  python3 benchmarks/gpu_check.py --sections "$SECTIONS" --master "local[${CORES:-16}]" \
    --repeats "${REPEATS:-3}" --lstm-seconds "${LSTM_SECONDS:-120}" \
    --amp-nets "${AMP_NETS:-fc,srcnn}" --lstm-configs "${LSTM_CONFIGS:-}" \
    --out "$RESULTS/gpu.json" ${APPEND:+--append} || rc=$?
fi
if [ -n "${SCALING:-}" ]; then
  python3 benchmarks/bench_scaling.py --replicas "${SCALING_REPLICAS:-1,${CORES:-16}}" --repeats "${SCALING_REPEATS:-1}" \
    --epochs "${SCALING_EPOCHS:-2}" \
    --strategies "${SCALING_STRATEGIES:-allreduce,downpour+lr,gossip}" \
    --first-seed "${SCALING_FIRST_SEED:-0}" ${SCALING_LR:+--lr "$SCALING_LR"} \
    --out "$RESULTS/${SCALING_OUT:-scaling-16.json}" || rc=$?
fi
if [ -n "${RUN:-}" ]; then           # TorchDistributor and spark_dl.run at CORES processes
  python3 benchmarks/bench_run.py --replicas "${CORES:-16}" --no-ray \
    --repeats "${RUN_REPEATS:-3}" --rows "${RUN_ROWS:-10000}" --epochs "${RUN_EPOCHS:-5}" \
    --out "$RESULTS/run-16.json" || rc=$?
fi
if [ -n "${STEP_COST:-}" ]; then     # where a step's time goes at CORES processes
  python3 benchmarks/ddp_step_cost.py --world "${CORES:-16}" \
    --modes "${STEP_COST_MODES:-one,nocomm,flat-shm,ddp-shm,run-ctx}" \
    --repeats "${STEP_COST_REPEATS:-2}" --steps "${STEP_COST_STEPS:-400}" \
    --out "$RESULTS/ddp-step-cost-16.json" || rc=$?
fi
if [ -n "${PS_CAPACITY:-}" ]; then   # the parameter server's pushes a second (no Spark)
  python3 benchmarks/bench_ps_capacity.py --clients "1,${CORES:-16}" \
    --repeats "${PS_CAPACITY_REPEATS:-3}" --pushes "${PS_CAPACITY_PUSHES:-1500}" \
    --out "$RESULTS/ps-capacity-16.json" || rc=$?
fi
if [ -n "${PS_SERVING:-}" ]; then    # threads against the event loop, training workers (no Spark)
  python3 benchmarks/bench_ps_serving.py --workers "${PS_SERVING_WORKERS:-4,8,16}" \
    --repeats "${PS_SERVING_REPEATS:-2}" --steps 2000 --out "$RESULTS/ps-serving-16.json" || rc=$?
fi
exit $rc
