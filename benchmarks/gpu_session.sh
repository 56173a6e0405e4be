#!/usr/bin/env bash
# One call on a lent machine with a GPU and 16 cores: everything benchmarks/gpu_check.sh
# measures there, time-boxed so that it fits one call of the device tool (about 9 minutes).
#
# What it does, in order, writing results files and logs into the folder given (the call's
# $OUT; copy nothing into it under the same names afterwards):
#   0. unpacks the offline bundle (Java, pyspark and the other wheels) from /tmp/stage/c*
#      into /tmp/bundle, unless it is there already (stage the chunks first, one call each);
#   1. with GPU=1: gpu_check.sh's GPU sections (one, amp, shared; then lstm) into gpu.json;
#   2. bench_scaling at 1 and 16 CPU replicas, the four strategies with their defaults,
#      SCALING_REPEATS (2) seeds of 3 epochs, at most SCALING_S (280) seconds: scaling-16.json;
#   3. in the time left of TOTAL (540) seconds, at most 200: bench_run at 16 processes with
#      WITH_RUN=1 (run-16.json), otherwise bench_ps_capacity at 1 and 16 clients
#      (ps-capacity-16.json).
# Every benchmark writes its results file after each repeat, so one cut short keeps what it
# finished. The logs' last lines are printed at the end.
#
#   bash benchmarks/gpu_session.sh "$OUT"
#   GPU=1 bash benchmarks/gpu_session.sh "$OUT"
#   TOTAL=560 SCALING_REPLICAS=1,4,8,16 SCALING_STRATEGIES=allreduce,downpour \
#     SCALING_REPEATS=3 SCALING_S=530 bash benchmarks/gpu_session.sh "$OUT"   # more counts
#   SCALING_LR=0.01 SCALING_OUT=scaling-16-lr0.01.json bash benchmarks/gpu_session.sh "$OUT"
set -u
O=$1
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
if [ ! -d /tmp/bundle/jre17 ]; then
  cat /tmp/stage/c* | xz -dc | tar -x -C /tmp || { echo "unpack failed"; ls -la /tmp/stage; exit 1; }
fi
echo "unpacked at $(el) s; $(nproc) cores"
lscpu | grep -E "Model name|Thread|Core|Socket|NUMA node\(s\)" || true
if [ -n "${GPU:-}" ]; then
  REPEATS=3 AMP_NETS=srcnn timeout 215 bash benchmarks/gpu_check.sh one,amp,shared "$O" > "$O/log1.txt" 2>&1
  echo "gpu sections rc=$? at $(el) s"
  APPEND=1 LSTM_SECONDS=120 timeout 210 bash benchmarks/gpu_check.sh lstm "$O" > "$O/log3.txt" 2>&1
  echo "lstm rc=$? at $(el) s"
fi
SCALING=1 SCALING_EPOCHS=3 SCALING_REPEATS=${SCALING_REPEATS:-2} \
  SCALING_STRATEGIES=${SCALING_STRATEGIES:-allreduce,gossip,downpour,boosting} \
  timeout ${SCALING_S:-280} bash benchmarks/gpu_check.sh "" "$O" > "$O/log2.txt" 2>&1
echo "scaling rc=$? at $(el) s"
secs=$(( ${TOTAL:-540} - $(el) )); [ $secs -gt 200 ] && secs=200
if [ -n "${WITH_RUN:-}" ] && [ $secs -gt 60 ]; then
  echo "bench_run seconds $secs"
  RUN=1 timeout $secs bash benchmarks/gpu_check.sh "" "$O" > "$O/log4.txt" 2>&1
  echo "bench_run rc=$? at $(el) s"
elif [ $secs -gt 30 ]; then
  echo "ps capacity seconds $secs"
  PS_CAPACITY=1 timeout $secs bash benchmarks/gpu_check.sh "" "$O" > "$O/log6.txt" 2>&1
  echo "ps capacity rc=$? at $(el) s"
  grep -E "^server|^plain" "$O/log6.txt" | tail -n 6
fi
grep -E "^\[" "$O/log2.txt" | tail -30
[ -f "$O/log4.txt" ] && grep -E "^run |samples/s" "$O/log4.txt" | tail -20
exit 0
