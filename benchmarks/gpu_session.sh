#!/usr/bin/env bash
# One call on a lent GPU machine (the device tool), after the offline bundle's chunks were
# staged in /tmp/stage one call each: unpack it, then gpu_check's GPU sections, the 16-core
# scaling case and the LSTM configurations, each with its own time limit, all within about
# 8 minutes; results and logs into the folder given (the call's $OUT). Used on 2026-11-27:
#   bash benchmarks/gpu_session.sh "$OUT"
set -u
O=$1
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
cat /tmp/stage/c* | xz -dc | tar -x -C /tmp || { echo "unpack failed"; ls -la /tmp/stage; exit 1; }
echo "unpacked at $(el) s; $(nproc) cores"
REPEATS=3 AMP_NETS=srcnn timeout 215 bash benchmarks/gpu_check.sh one,amp,shared "$O" > "$O/log1.txt" 2>&1
echo "gpu sections rc=$? at $(el) s"
SCALING=1 SCALING_EPOCHS=3 SCALING_STRATEGIES=allreduce,allreduce~sqrt,gossip,gossip~sqrt,downpour+lr \
  timeout 190 bash benchmarks/gpu_check.sh "" "$O" > "$O/log2.txt" 2>&1
echo "scaling rc=$? at $(el) s"
secs=$(( 470 - $(el) )); [ $secs -gt 180 ] && secs=180
echo "lstm seconds $secs"
if [ $secs -gt 45 ]; then
  APPEND=1 LSTM_SECONDS=$secs timeout $((secs + 90)) bash benchmarks/gpu_check.sh lstm "$O" > "$O/log3.txt" 2>&1
  echo "lstm rc=$? at $(el) s"
fi
grep -E "section|rc=|Error|error" "$O/log1.txt" | tail -20
grep -E "^\[" "$O/log2.txt" | tail -20
grep -E "updates" "$O/log3.txt" | tail -12
