#!/usr/bin/env bash
# The GPU checks, and the 16-core CPU cases, on a machine with a GPU and many cores.
#
# What it does: runs benchmarks/gpu_check.py's sections (one replica on the GPU against plain
# PyTorch on the same GPU, mixed precision, two replicas sharing the GPU in every strategy,
# the character LSTM) into RESULTS/gpu.json; and, when asked, the CPU benchmarks at as many
# replicas as the machine has cores. Run it from the repository root. On a machine without
# Java or pyspark, unpack ../shared/tools/offline-bundle.sh's archive into /tmp first: the
# script then finds /tmp/bundle and runs this checkout's spark_dl with it.
#
#   bash benchmarks/gpu_check.sh [SECTIONS] [RESULTS]   # SECTIONS: one,amp,shared,lstm (all);
#                                                       # RESULTS: benchmarks/results
#   SCALING=1 bash benchmarks/gpu_check.sh ""           # only bench_scaling at 1 and CORES
#                                                       # replicas (RESULTS/scaling-16.json)
#   RUN=1 bash benchmarks/gpu_check.sh ""               # only bench_run at CORES processes
#                                                       # (RESULTS/run-16.json)
#   PS_CAPACITY=1 bash benchmarks/gpu_check.sh ""       # only bench_ps_capacity at 1 and
#                                                       # CORES clients (RESULTS/ps-capacity-16.json)
#   STEP_COST=1 bash benchmarks/gpu_check.sh ""         # only ddp_step_cost at CORES
#                                                       # processes (RESULTS/ddp-step-cost-16.json)
#
# Settings from the environment (defaults in brackets): CORES [16], REPEATS [3],
# LSTM_SECONDS [120], LSTM_CONFIGS [all of gpu_check.py's], AMP_NETS [fc,srcnn], APPEND
# (add to an existing gpu.json); SCALING_REPLICAS [1,CORES], SCALING_STRATEGIES
# [allreduce,gossip,downpour,boosting], SCALING_EPOCHS [2], SCALING_REPEATS [1],
# SCALING_FIRST_SEED [0], SCALING_LR [bench_scaling's], SCALING_OUT [scaling-16.json];
# RUN_REPEATS [3], RUN_ROWS [10000], RUN_EPOCHS [5]; PS_CAPACITY_REPEATS [3],
# PS_CAPACITY_PUSHES [1500]; STEP_COST_MODES [one,nocomm,flat-shm,ddp-shm,run-ctx],
# STEP_COST_REPEATS [2], STEP_COST_STEPS [400]. The exit status is the last failing step's (0 when all ran).
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
if [ -n "${SCALING:-}" ]; then       # time to accuracy at 1 and CORES CPU replicas
  python3 benchmarks/bench_scaling.py --replicas "${SCALING_REPLICAS:-1,${CORES:-16}}" \
    --repeats "${SCALING_REPEATS:-1}" --epochs "${SCALING_EPOCHS:-2}" \
    --strategies "${SCALING_STRATEGIES:-allreduce,gossip,downpour,boosting}" \
    --first-seed "${SCALING_FIRST_SEED:-0}" ${SCALING_LR:+--lr "$SCALING_LR"} \
    --out "$RESULTS/${SCALING_OUT:-scaling-16.json}" || rc=$?
fi
if [ -n "${RUN:-}" ]; then           # TorchDistributor and spark_dl.run at CORES processes
  python3 benchmarks/bench_run.py --replicas "${CORES:-16}" --no-ray \
    --repeats "${RUN_REPEATS:-3}" --rows "${RUN_ROWS:-10000}" --epochs "${RUN_EPOCHS:-5}" \
    --out "$RESULTS/run-16.json" || rc=$?
fi
if [ -n "${PS_CAPACITY:-}" ]; then   # the parameter server's pushes a second (no Spark)
  python3 benchmarks/bench_ps_capacity.py --clients "1,${CORES:-16}" \
    --repeats "${PS_CAPACITY_REPEATS:-3}" --pushes "${PS_CAPACITY_PUSHES:-1500}" \
    --out "$RESULTS/ps-capacity-16.json" || rc=$?
fi
if [ -n "${STEP_COST:-}" ]; then     # a step's time at CORES processes against no communication
  python3 benchmarks/ddp_step_cost.py --world "${CORES:-16}" \
    --modes "${STEP_COST_MODES:-one,nocomm,flat-shm,ddp-shm,run-ctx}" \
    --repeats "${STEP_COST_REPEATS:-2}" --steps "${STEP_COST_STEPS:-400}" \
    --out "$RESULTS/ddp-step-cost-16.json" || rc=$?
fi
exit $rc
