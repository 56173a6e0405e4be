#!/usr/bin/env bash
# The super-resolution job once per degradation (conf/jobs/superres-sweep.toml, the SRCNN with
# the noisy skip), Set5 x2: Gaussian noise sigma 20, 25, 30 (on 0-255), Gaussian blur (std 1
# LR pixel), salt-and-pepper (5% of the pixels) and blur + Gaussian sigma 20; about 10 minutes
# a row on 2 cores. Each row's job summary and report stay in $SCRATCH/<row>/; their figures
# replace the row in benchmarks/results/quality/superres-degradations.json (or $OUT), under
# the key $KEY ("rows", the table of docs/quality.md; another key keeps a variant apart).
# Rows can be named, and $EXTRA adds --set options to every row:
#   benchmarks/superres_degradations.sh gaussian25 blur
#   EXTRA="--set cnn_noisy_skip=false" KEY=without_noisy_skip benchmarks/superres_degradations.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
DEST="${OUT:-benchmarks/results/quality/superres-degradations.json}"
SCRATCH="${SCRATCH:-runs/superres-sweep}"      # patches, models, reports
declare -A ROWS=(
  [gaussian20]="--set noise='gaussian' --set sigma=20"
  [gaussian25]="--set noise='gaussian' --set sigma=25"
  [gaussian30]="--set noise='gaussian' --set sigma=30"
  [blur]="--set noise='blur' --set blur=1.0"
  [salt_pepper]="--set noise='salt_pepper' --set amount=0.05"
  [blur_gaussian]="--set noise='blur+gaussian' --set blur=1.0 --set sigma=20"
)
ORDER=(gaussian20 gaussian25 gaussian30 blur salt_pepper blur_gaussian)
[ $# -gt 0 ] && ORDER=("$@")
for row in "${ORDER[@]}"; do
  [ -n "${ROWS[$row]:-}" ] || { echo "unknown row $row; rows: ${!ROWS[*]}" >&2; exit 2; }
  mkdir -p "$SCRATCH/$row"
  # shellcheck disable=SC2086  # the row's --set options are split on purpose
  spark-submit --properties-file conf/spark/local.conf jobs/superres.py \
      --config conf/jobs/superres-sweep.toml ${ROWS[$row]} --set cnn_noisy_skip=true \
      ${EXTRA:-} --set "run.out_dir='$SCRATCH/$row'" 2>&1 | tee "$SCRATCH/$row/job.log" | \
      grep -v "step "
done
python - "$DEST" "${KEY:-rows}" "$SCRATCH" "${ORDER[@]}" <<'PY'
import json, subprocess, sys
from pathlib import Path
dest, key, scratch, rows = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4:]
data = json.loads(dest.read_text()) if dest.exists() else {}
section = data if key == "rows" else data.setdefault(key, {})
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                        text=True).stdout.strip()
kept = {r["row"]: r for r in section.get("rows", [])}
for row in rows:
    job = json.loads(next((scratch / row).glob("superres-*.json")).read_text())
    rep = json.loads((scratch / row / "report" / "report.json").read_text())
    kept[row] = {"row": row, "degradation": rep["degradation"], "average": rep["average"],
                 "overrides": job.get("overrides"), "srcnn_active_units":
                 job.get("srcnn_active_units"), "date": job.get("date"),
                 "cnn_loss": [h["loss"] for h in job["histories"]["cnn"]],
                 "source": str(scratch / row), "measured_at": commit}
order = ["gaussian20", "gaussian25", "gaussian30", "blur", "salt_pepper", "blur_gaussian"]
section["rows"] = sorted(kept.values(), key=lambda r: order.index(r["row"]))
dest.write_text(json.dumps(data, indent=1) + "\n")
for r in section["rows"]:
    a = r["average"]
    print(f"{r['row']:14s} cascade {a['cascade']['psnr']:.2f} dB, thesis's conventional "
          f"{a['thesis_conventional']['psnr']:.2f} dB")
PY
