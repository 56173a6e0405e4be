#!/usr/bin/env bash
# Quality runs of the model zoo (issue: models on real data), single process, written to
# benchmarks/results/quality/ (or $OUT when set). Groups: mnist | text | sr | all, and
# allreduce (the thesis CNN single-process vs the all-reduce engine, same global batch),
# downpour (the thesis CNN with asynchronous Downpour SGD on local[*] and local-cluster),
# hybrid (the widened FC net: one process vs 2 replicas x 2 column partitions),
# text-2cores (the char LSTM for 20 minutes on 2 CPU cores),
# model-parallel (2 replicas x 2 column partitions on local-cluster against one process: the
# thesis CNN, the FC net with the thesis's algorithm, the char LSTM; the SSDA split in two;
# the thesis's Fig. 4.3 drawn from the split runs),
# ships-seeds (the ships group's systems at train.seed 1..4), ships-clip (Downpour with and
# without clipped pushes, interleaved, then over seeds),
# ships-fresh (Boosting with fresh values mid-key and the cap against without, interleaved,
# then over seeds),
# split (the split runs of hybrid and model-parallel again, their one-process references
# not: they do not depend on the parameter server; to refresh them after a server change).
# The groups that compared staleness rules since removed (ships-step, ships-halfway,
# ships-worker, ships-worker-seeds, ships-boosting-worker, cnn-bn-worker) went with them;
# their results stay in benchmarks/results/quality/ (docs/guides/downpour.md, "Staleness rule").
#   PYTHON=.venv/bin/python benchmarks/quality_runs.sh mnist
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DEST="${OUT:-benchmarks/results/quality}"
mkdir -p "$DEST"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export SPARK_CONF_DIR="${SPARK_CONF_DIR:-$PWD/conf/logging}"   # spark-submit runs: quiet log4j
SCRATCH="$(mktemp -d)"            # checkpoints stay out of $DEST; results and logs go there
run() {
  local name="$1"; shift
  "$PY" "$@" --set "run.out_dir='$SCRATCH/$name'" 2>&1 | tee "$DEST/$name.log"
  cp "$SCRATCH/$name"/*.json "$DEST/"
}
run_named() {                     # as run, the result file named after the run
  local name="$1"; shift
  "$PY" "$@" --set "run.out_dir='$SCRATCH/$name'" 2>&1 | tee "$DEST/$name.log"
  cp "$SCRATCH/$name"/*.json "$DEST/$name.json"
}
group="${1:-all}"
if [ "$group" = mnist ] || [ "$group" = all ]; then
  run cnn-sgd jobs/train_mnist.py --config conf/jobs/cnn.toml
  run cnn-adam jobs/train_mnist.py --config conf/jobs/cnn.toml --set train.optimizer=adam \
      --set train.lr=0.001 --set train.batch_size=64
  run fc-cg jobs/train_mnist.py --config conf/jobs/fc.toml
  run fc-adam jobs/train_mnist.py --config conf/jobs/fc.toml --set train.optimizer=adam \
      --set train.lr=0.001 --set train.batch_size=64
  run fc-sgd jobs/train_mnist.py --config conf/jobs/fc.toml --set train.optimizer=sgd \
      --set train.lr=0.1 --set train.batch_size=32
  run fc-lbfgs jobs/train_mnist.py --config conf/jobs/fc.toml --set train.optimizer=lbfgs
fi
if [ "$group" = text ] || [ "$group" = all ]; then
  run char-lstm jobs/train_char.py --config conf/jobs/char_lstm.toml
  run char-rnn jobs/train_char.py --config conf/jobs/char_rnn.toml
fi
if [ "$group" = text-2cores ]; then  # the issue's budget: 20 minutes on 2 CPU cores
  run_named char-lstm-2cores-20min jobs/train_char.py --config conf/jobs/char_lstm.toml \
      --set run.device=cpu --set run.threads=2 --set time_budget_s=1200 \
      --set updates=1000000 --set dropout=0.25 --set lr=0.003 --set lr_decay=0.8 \
      --set eval_every=1000
fi
if [ "$group" = sr ] || [ "$group" = all ]; then
  run ssda jobs/train_ssda.py --config conf/jobs/ssda.toml
  run srcnn jobs/train_srcnn.py --config conf/jobs/srcnn.toml
fi
if [ "$group" = allreduce ]; then
  # Same data, model, optimizer and global batch (16): one process (2 threads) vs 2 replicas
  # x 8 on Spark local[*] (1 thread each).
  run cnn-sgd-single jobs/train_mnist.py --config conf/jobs/cnn.toml --set run.threads=2
  run cnn-sgd-allreduce jobs/train_mnist.py --config conf/jobs/cnn.toml \
      --set train.strategy=allreduce --set train.batch_size=8
fi
if [ "$group" = downpour ]; then
  # Asynchronous Downpour SGD, 2 replicas x batch 16 against the parameter server, the same
  # data, lr and decay as cnn-sgd-single (allreduce group); momentum 0.8 on the server, as two
  # asynchronous replicas add momentum of their own (the plain rule, staleness=none: these
  # runs were recorded before the staleness rules). On local[*], then on local-cluster (two
  # executor JVMs) through spark-submit.
  run_named cnn-sgd-downpour jobs/train_mnist.py --config conf/jobs/cnn.toml \
      --set train.strategy=downpour --set train.momentum=0.8 --set train.strategy.staleness=none
  BIN="$(cd "$(dirname "$PY")" && pwd)"
  PYSPARK_PYTHON="$BIN/python" SPARK_LOCAL_IP=127.0.0.1 PY="$BIN/spark-submit" \
      run_named cnn-sgd-downpour-local-cluster --properties-file conf/spark/local-cluster.conf \
      jobs/train_mnist.py --config conf/jobs/cnn.toml --set train.strategy=downpour \
      --set train.momentum=0.8 --set train.strategy.staleness=none
fi
if [ "$group" = hybrid ] || [ "$group" = split ]; then
  # The widened FC net in one process (2 threads), then Downpour over 2 replicas, each split
  # by columns over 2 tasks (micro-batches of 16: a replica's step is 32 samples, as the
  # single run's), on local[4] and on local-cluster (2 executors x 2 cores). Momentum 0.8 on
  # the server: with 0.9 the asynchronous sigmoid net sat on its initial plateau for an
  # epoch (local[4]) or for good (local-cluster, 6 epochs at chance); lr 0.15: at 0.1 with
  # momentum 0.8 (half the single run's effective step) it ended 0.8 points behind.
  [ "$group" = split ] || [ -f "$DEST/fc-wide-single.json" ] && [ -z "${RERUN:-}" ] || \
    run_named fc-wide-single jobs/train_mnist.py --config conf/jobs/fc_hybrid.toml \
      --set run.threads=2
  BIN="$(cd "$(dirname "$PY")" && pwd)"
  HYBRID=(jobs/train_mnist.py --config conf/jobs/fc_hybrid.toml --set train.strategy=downpour
          --set train.strategy.partitions=2 --set train.replicas=2 --set train.batch_size=16
          --set train.momentum=0.8 --set train.lr=0.15 --set train.strategy.staleness=none)
  PYSPARK_PYTHON="$BIN/python" SPARK_LOCAL_IP=127.0.0.1 PY="$BIN/spark-submit" \
      run_named fc-wide-hybrid-local4 --master "local[4]" "${HYBRID[@]}"
  PYSPARK_PYTHON="$BIN/python" SPARK_LOCAL_IP=127.0.0.1 PY="$BIN/spark-submit" \
      run_named fc-wide-hybrid-local-cluster --properties-file conf/spark/local-cluster.conf \
      --master "local-cluster[2,2,1024]" "${HYBRID[@]}"
fi
if [ "$group" = model-parallel ] || [ "$group" = split ]; then
  # Every replica split over F = 2 tasks, 2 replicas, on local-cluster[2,2,1024] (two executor
  # JVMs of 2 cores: the 4 tasks of one barrier stage), against one process with 1 thread on
  # the same data. A replica's step is the single run's batch (each task draws half), each
  # push one server step; the single run's lr and momentum 0.9, which the default staleness
  # rule lowers to 0.4 on the server (two asynchronous replicas add momentum of their own).
  # The digits: 100,000 distorted + 8,000 real (half the mnist group's, to fit the session).
  BIN="$(cd "$(dirname "$PY")" && pwd)"
  SUBMIT=(--properties-file conf/spark/local-cluster.conf --master "local-cluster[2,2,1024]")
  MP=(--set train.strategy=downpour --set train.strategy.partitions=2 --set train.replicas=2)
  [ "$group" = split ] || run_named cnn-mp-single jobs/train_mnist.py \
      --config conf/jobs/cnn.toml --set data.extended_samples=100000 --set run.threads=1
  PYSPARK_PYTHON="$BIN/python" SPARK_LOCAL_IP=127.0.0.1 PY="$BIN/spark-submit" \
      run_named cnn-2x2 "${SUBMIT[@]}" jobs/train_mnist.py --config conf/jobs/cnn.toml \
      --set data.extended_samples=100000 "${MP[@]}" --set train.batch_size=8
  FC=(--set data.extended_samples=100000 --set train.optimizer=sgd --set train.lr=0.1)
  [ "$group" = split ] || run_named fc-mp-single jobs/train_mnist.py \
      --config conf/jobs/fc.toml "${FC[@]}" --set train.batch_size=32 --set run.threads=1
  PYSPARK_PYTHON="$BIN/python" SPARK_LOCAL_IP=127.0.0.1 PY="$BIN/spark-submit" \
      run_named fc-thesis-2x2 "${SUBMIT[@]}" jobs/train_mnist.py --config conf/jobs/fc.toml \
      "${FC[@]}" "${MP[@]}" --set train.strategy.model_parallel=thesis --set train.batch_size=16
  if [ "$group" = model-parallel ]; then
    # char LSTM: 900 server updates each (single: 900 steps of 32 sequences; 2 x 2: each
    # replica 450 steps of 2 tasks x 16 streams, 150 steps an epoch, 3 epochs; a split step
    # takes about a second on 2 cores: every time step of both layers gathers the hidden units)
    run_named char-mp-single jobs/train_char.py --config conf/jobs/char_lstm.toml \
        --set updates=900 --set eval_every=300 --set run.threads=1
    PYSPARK_PYTHON="$BIN/python" SPARK_LOCAL_IP=127.0.0.1 PY="$BIN/spark-submit" \
        run_named char-lstm-2x2 "${SUBMIT[@]}" jobs/train_char.py \
        --config conf/jobs/char_lstm.toml --set strategy=downpour --set partitions=2 \
        --set replicas=2 --set updates=450
    # ... and one task on Spark reading the same stream-ordered windows (the single job draws
    # random 1,000-character windows, each from a zero state): the reference for the split
    PYSPARK_PYTHON="$BIN/python" SPARK_LOCAL_IP=127.0.0.1 PY="$BIN/spark-submit" \
        run_named char-lstm-1x1 "${SUBMIT[@]}" jobs/train_char.py \
        --config conf/jobs/char_lstm.toml --set strategy=downpour --set partitions=1 \
        --set replicas=1 --set updates=900
    SPARK_LOCAL_IP=127.0.0.1 "$PY" benchmarks/quality_ssda_partitions.py \
        --out "$DEST/ssda-partitions.json" 2>&1 | tee "$DEST/ssda-partitions.log"
  fi
  "$PY" - "$DEST" <<'PLOT'
import json, sys
from pathlib import Path
from spark_dl.runs import plot_convergence
dest = Path(sys.argv[1])
for name, title in (("fc-thesis-2x2", "FC 784-480-160-10, thesis algorithm, R = 2 x F = 2"),
                    ("cnn-2x2", "thesis CNN, R = 2 x F = 2")):
    h = json.loads((dest / f"{name}.json").read_text())["history"]
    plot_convergence(dest / f"fig4.3-{name}.png", {name: h}, f"Fig. 4.3: {title}")
PLOT
fi
if [ "$group" = ships ]; then
  # conf/jobs/ships.toml as shipped (4 epochs): one process (AllReduce, 1 replica), then the
  # boosting server and Downpour (async, its defaults) with 2 workers, RUNS runs each of one
  # config (they differ by the order in which the pushes land); then the U-Net with BatchNorm
  # (train.norm=batch) through each (its running statistics through the parameter server).
  SHIPS=(jobs/segment_ships.py --config conf/jobs/ships.toml)
  run_named ships-single "${SHIPS[@]}" --set train.strategy=allreduce --set train.replicas=1
  for i in $(seq 1 "${RUNS:-5}"); do
    run_named "ships-boosting-$i" "${SHIPS[@]}" --set train.replicas=2
    run_named "ships-downpour-$i" "${SHIPS[@]}" --set train.strategy=downpour \
        --set train.replicas=2
  done
  for s in allreduce boosting downpour; do
    reps=2; [ "$s" = allreduce ] && reps=1
    run_named "ships-bn-$s" "${SHIPS[@]}" --set train.strategy=$s --set train.replicas=$reps \
        --set train.norm=batch
  done
fi
if [ "$group" = ships-seeds ]; then
  # The ships group's three systems again at train.seed 1..4 (the model's initial weights and
  # the order of the rows; the ships group runs seed 0), so that each is compared over seeds;
  # then Downpour with its server's momentum at 0 (fit's momentum 0.5, less the rule's 1 - 1/2)
  # at seeds 0..2.
  SHIPS=(jobs/segment_ships.py --config conf/jobs/ships.toml)
  for s in 1 2 3 4; do
    run_named "ships-single-seed$s" "${SHIPS[@]}" --set train.strategy=allreduce \
        --set train.replicas=1 --set train.seed=$s
  done
  for s in 1 2 3 4; do
    for st in boosting downpour; do
      run_named "ships-$st-seed$s" "${SHIPS[@]}" --set train.strategy=$st --set train.replicas=2 \
          --set train.seed=$s
    done
  done
  for s in 0 1 2; do
    run_named "ships-downpour-m0-seed$s" "${SHIPS[@]}" --set train.strategy=downpour \
        --set train.replicas=2 --set train.seed=$s --set train.momentum=0.5
  done
fi
if [ "$group" = ships-clip ]; then
  # Downpour (async) on the ships job with and without clipped pushes (clip=2, the default
  # since 2026-11-27: a push's step at most twice the running gradient norm; clip=0: off),
  # interleaved, RUNS runs (default 5) of seed 0 each; then SEEDS (default "1 2 3 4")
  # clipped, and the U-Net with BatchNorm.
  SHIPS=(jobs/segment_ships.py --config conf/jobs/ships.toml --set train.replicas=2)
  CLIP="train.strategy={'name': 'downpour', 'clip': ${CLIP:-2.0}}"
  for i in $(seq 1 "${RUNS:-5}"); do
    run_named "ships-downpour-clip-$i" "${SHIPS[@]}" --set "$CLIP"
    run_named "ships-downpour-noclip-$i" "${SHIPS[@]}" \
        --set "train.strategy={'name': 'downpour', 'clip': 0}"
  done
  for s in ${SEEDS-1 2 3 4}; do
    run_named "ships-downpour-clip-seed$s" "${SHIPS[@]}" --set "$CLIP" --set train.seed=$s
  done
  run_named ships-bn-downpour-clip "${SHIPS[@]}" --set "$CLIP" --set train.norm=batch
fi
if [ "$group" = ships-fresh ]; then
  # Boosting on the ships job with its defaults of 2026-11-27 (fresh values mid-key and
  # clipped pushes with several workers) against the old ones (fresh=False, clip=0),
  # interleaved, RUNS runs (default 5) of seed 0 each, one process once; then SEEDS (default
  # "1 2 3 4") with the defaults, and the U-Net with BatchNorm.
  SHIPS=(jobs/segment_ships.py --config conf/jobs/ships.toml --set train.replicas=2)
  [ -n "${NO_SINGLE:-}" ] || run_named ships-single "${SHIPS[@]}" \
      --set train.strategy=allreduce --set train.replicas=1
  for i in $(seq 1 "${RUNS:-5}"); do
    run_named "ships-boosting-fresh-$i" "${SHIPS[@]}"
    run_named "ships-boosting-old-$i" "${SHIPS[@]}" \
        --set "train.strategy={'name': 'boosting', 'fresh': False, 'clip': 0}"
  done
  for s in ${SEEDS-1 2 3 4}; do
    run_named "ships-boosting-fresh-seed$s" "${SHIPS[@]}" --set train.seed=$s
  done
  run_named ships-bn-boosting-fresh "${SHIPS[@]}" --set train.norm=batch
fi
if [ "$group" = cnn-bn ]; then
  # The thesis CNN with BatchNorm (train.model=cnn_bn) on a quarter of the digits (50,000
  # distorted + 8,000 real), 4 epochs, 2 replicas x batch 16: AllReduce, Downpour (async,
  # its defaults) and the boosting server (keys of 4 mini-batches), equal epochs.
  CNN=(jobs/train_mnist.py --config conf/jobs/cnn.toml --set train.model=cnn_bn
       --set data.extended_samples=50000 --set train.epochs=4 --set train.replicas=2)
  for s in allreduce downpour boosting; do
    run_named "cnn-bn-$s" "${CNN[@]}" --set train.strategy=$s
  done
fi
