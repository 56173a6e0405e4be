#!/usr/bin/env bash
# The runs behind the tables of docs/quality.md, one group per table. Each run's results JSON
# and log go to $OUT (default runs/quality/); the page reads the per-workload summaries in
# benchmarks/results/quality/, and a new run replaces its row there with
#   python benchmarks/quality_report.py --add WORKLOAD ROW runs/quality/NAME.json [...]
# (then python benchmarks/quality_report.py redraws the page).
#
#   mnist        the optimizers on extended MNIST at full size (208,000 digits, 8 epochs):
#                the thesis CNN with SGD and Adam, the FC net with CG and Adam (a GPU picks
#                itself up; on CPUs these take hours)
#   line-search  the FC net with L-BFGS and with CG at the reduced size (108,000 digits), on
#                one core (CORE, default 1): about 7 minutes each when the core is free
#   allreduce    the thesis CNN in one process (2 threads) against AllReduce, 2 replicas x 8
#   model-parallel  2 replicas x 2 column partitions on local-cluster[2,2,1024] against one
#                process: the thesis CNN, the FC net with the thesis's algorithm, the widened
#                FC net (also on local[4]), the char LSTM (and Downpour 1 x 1 on the same
#                windows), the SSDA (benchmarks/quality_ssda_partitions.py)
#   text         the char RNN and LSTM, 2 x 200, 5,000 updates; the LSTM with dropout 0.25 and
#                a decaying rate for 12,000
#   text-2cores  that LSTM for 20 minutes on 2 CPU cores
#   sr           the SRCNN x2 alone (T91 -> Set5)
#   superres     the super-resolution job at the quality configuration (sigma 20, about an hour
#                on 2 cores), then two continuations of its cascade stage (3 epochs each)
#   degradations benchmarks/superres_degradations.sh (six degradations, about an hour)
#   ships        the ships U-Net: one process at seeds 0-5, Boosting with 2 and 4 workers at
#                seeds 0-5, Downpour with 2 and 4 workers at seeds 0-2 (4 workers on local[4])
#   counting     the MCNN at 1/4 resolution and with transposed convolutions
#
#   PYTHON=.venv/bin/python benchmarks/quality_runs.sh line-search
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
BIN="$(cd "$(dirname "$(command -v "$PY")")" && pwd)"
DEST="${OUT:-runs/quality}"
mkdir -p "$DEST"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export SPARK_CONF_DIR="${SPARK_CONF_DIR:-$PWD/conf/logging}"   # spark-submit runs: quiet log4j
export PYSPARK_PYTHON="$BIN/python" SPARK_LOCAL_IP="${SPARK_LOCAL_IP:-127.0.0.1}"
SCRATCH="$(mktemp -d)"            # checkpoints stay out of $DEST
run() {                           # run NAME COMMAND...: the job's results JSON as $DEST/NAME.json
  local name="$1"; shift
  "$@" --set "run.out_dir='$SCRATCH/$name'" 2>&1 | tee "$DEST/$name.log"
  cp "$SCRATCH/$name"/*.json "$DEST/$name.json"
}
SUBMIT=("$BIN/spark-submit" --properties-file conf/spark/local-cluster.conf
        --master "local-cluster[2,2,1024]")
MNIST=("$PY" jobs/train_mnist.py)
CHAR=("$PY" jobs/train_char.py --config conf/jobs/char_lstm.toml)
SHIPS=(jobs/segment_ships.py --config conf/jobs/ships.toml)
group="${1:?name a group: mnist line-search allreduce model-parallel text text-2cores sr superres degradations ships counting}"
case "$group" in
mnist)
  run cnn-sgd "${MNIST[@]}" --config conf/jobs/cnn.toml
  run cnn-adam "${MNIST[@]}" --config conf/jobs/cnn.toml --set train.optimizer=adam \
      --set train.lr=0.001 --set train.batch_size=64
  run fc-cg "${MNIST[@]}" --config conf/jobs/fc.toml
  run fc-adam "${MNIST[@]}" --config conf/jobs/fc.toml --set train.optimizer=adam \
      --set train.lr=0.001 --set train.batch_size=64 ;;
line-search)
  for opt in lbfgs cg; do
    run "fc-$opt-100k" taskset -c "${CORE:-1}" "${MNIST[@]}" --config conf/jobs/fc.toml \
        --set train.optimizer=$opt --set data.extended_samples=100000 --set run.threads=1 \
        --set run.device=cpu
  done ;;
allreduce)
  run cnn-one-cpu "${MNIST[@]}" --config conf/jobs/cnn.toml --set run.threads=2
  run cnn-allreduce "${MNIST[@]}" --config conf/jobs/cnn.toml --set train.strategy=allreduce \
      --set train.batch_size=8 ;;
model-parallel)
  MP=(--set train.strategy=downpour --set train.strategy.partitions=2 --set train.replicas=2)
  HALF=(--set data.extended_samples=100000)
  FC=(--config conf/jobs/fc.toml "${HALF[@]}" --set train.optimizer=sgd --set train.lr=0.1)
  run cnn-one-100k "${MNIST[@]}" --config conf/jobs/cnn.toml "${HALF[@]}" --set run.threads=1
  run cnn-2x2 "${SUBMIT[@]}" jobs/train_mnist.py --config conf/jobs/cnn.toml "${HALF[@]}" \
      "${MP[@]}" --set train.batch_size=8
  run fc-one-100k "${MNIST[@]}" "${FC[@]}" --set train.batch_size=32 --set run.threads=1
  run fc-2x2 "${SUBMIT[@]}" jobs/train_mnist.py "${FC[@]}" "${MP[@]}" \
      --set train.strategy.model_parallel=thesis --set train.batch_size=16
  # the widened FC net: momentum 0.8 and lr 0.15 on the server, the plain rule
  WIDE=(jobs/train_mnist.py --config conf/jobs/fc_hybrid.toml "${MP[@]}" --set train.batch_size=16
        --set train.momentum=0.8 --set train.lr=0.15 --set train.strategy.staleness=none)
  run fcw-one "${MNIST[@]}" --config conf/jobs/fc_hybrid.toml --set run.threads=2
  run fcw-2x2-local4 "$BIN/spark-submit" --master "local[4]" "${WIDE[@]}"
  run fcw-2x2-cluster "${SUBMIT[@]}" "${WIDE[@]}"
  # the char LSTM: 900 server updates each (2 x 2: each replica 450 steps of 2 tasks x 16
  # streams); Downpour 1 x 1 reads the same stream-ordered windows as the split
  run one-900 "${CHAR[@]}" --set updates=900 --set eval_every=300 --set run.threads=1
  run 2x2 "${SUBMIT[@]}" jobs/train_char.py --config conf/jobs/char_lstm.toml \
      --set strategy=downpour --set partitions=2 --set replicas=2 --set updates=450
  run 1x1 "${SUBMIT[@]}" jobs/train_char.py --config conf/jobs/char_lstm.toml \
      --set strategy=downpour --set partitions=1 --set replicas=1 --set updates=900
  # the SSDA split: these two write their results files in benchmarks/results/quality/
  "$PY" benchmarks/quality_ssda_partitions.py 2>&1 | tee "$DEST/ssda-partitions.log"
  "$PY" benchmarks/quality_ssda_partitions.py --configs 2x2 --shuffle-rows \
      --out benchmarks/results/quality/ssda-partitions-shuffled.json ;;
text)
  run rnn "$PY" jobs/train_char.py --config conf/jobs/char_rnn.toml
  run lstm "${CHAR[@]}"
  run lstm-best "${CHAR[@]}" --set dropout=0.25 --set lr=0.003 --set lr_decay=0.8 \
      --set updates=12000 ;;
text-2cores)
  run lstm-2cores "${CHAR[@]}" --set run.device=cpu --set run.threads=2 \
      --set time_budget_s=1200 --set updates=1000000 --set dropout=0.25 --set lr=0.003 \
      --set lr_decay=0.8 --set eval_every=1000 ;;
sr)
  run srcnn "$PY" jobs/train_srcnn.py --config conf/jobs/srcnn.toml ;;
superres)
  SR=("$BIN/spark-submit" --properties-file conf/spark/local.conf jobs/superres.py
      --config conf/jobs/superres-quality.toml)
  "${SR[@]}" --set "run.out_dir='runs/superres-q'" 2>&1 | tee "$DEST/superres.log"
  "${SR[@]}" --set "init_from='runs/superres-q'" --set cascade_epochs=3 --set cascade_lr=5e-5 \
      --set "run.out_dir='runs/superres-q2'" 2>&1 | tee -a "$DEST/superres.log"
  "${SR[@]}" --set "init_from='runs/superres-q2'" --set cascade_epochs=3 \
      --set cascade_lr=3e-5 --set "run.out_dir='runs/superres-q3'" 2>&1 | \
      tee -a "$DEST/superres.log"
  cp runs/superres-q3/report/report.json "$DEST/superres-report.json" ;;
degradations)
  benchmarks/superres_degradations.sh ;;
ships)
  for s in 0 1 2 3 4 5; do
    run "one-seed$s" "$PY" "${SHIPS[@]}" --set train.strategy=allreduce \
        --set train.replicas=1 --set train.seed=$s
    run "boosting-2-seed$s" "$PY" "${SHIPS[@]}" --set train.replicas=2 --set train.seed=$s
    run "boosting-4-seed$s" "$BIN/spark-submit" --master "local[4]" "${SHIPS[@]}" \
        --set train.replicas=4 --set train.seed=$s
  done
  for s in 0 1 2; do
    run "downpour-2-seed$s" "$PY" "${SHIPS[@]}" --set train.strategy=downpour \
        --set train.replicas=2 --set train.seed=$s
    run "downpour-4-seed$s" "$BIN/spark-submit" --master "local[4]" "${SHIPS[@]}" \
        --set train.strategy=downpour --set train.replicas=4 --set train.seed=$s
  done ;;
counting)
  for m in mcnn mcnn-deconv; do
    run "$m" "$PY" jobs/count_objects.py --config conf/jobs/counting.toml --set train.model=$m
  done ;;
*)
  echo "unknown group $group" >&2; exit 2 ;;
esac
