#!/usr/bin/env bash
# The super-resolution job once per degradation (conf/jobs/superres-sweep.toml), Set5 x2:
# Gaussian noise sigma 20, 25, 30 (on 0-255), Gaussian blur (std 1 LR pixel), salt-and-pepper
# (5% of the pixels) and blur + Gaussian sigma 20. Each row's report and job summary go to
# benchmarks/results/superres-degradations/<row>/ (or $OUT/<row>), and summary.md gathers the
# averages. Rows to run can be named: benchmarks/superres_degradations.sh gaussian25 blur
# $EXTRA adds --set options to every row, e.g. the noisy skip (docs/quality.md):
#   EXTRA="--set cnn_noisy_skip=true" OUT=benchmarks/results/superres-degradations-skip \
#       SCRATCH=runs/superres-sweep-skip benchmarks/superres_degradations.sh blur gaussian20
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
DEST="${OUT:-benchmarks/results/superres-degradations}"
SCRATCH="${SCRATCH:-runs/superres-sweep}"      # patches and models stay out of $DEST
declare -A ROWS=(
  [gaussian20]="--set noise='gaussian' --set sigma=20"
  [gaussian25]="--set noise='gaussian' --set sigma=25"
  [gaussian30]="--set noise='gaussian' --set sigma=30"
  [blur]="--set noise='blur' --set blur=1.0"
  [salt_pepper]="--set noise='salt_pepper' --set amount=0.05"
  [blur_gaussian]="--set noise='blur+gaussian' --set blur=1.0 --set sigma=20"
)
ALL=(gaussian20 gaussian25 gaussian30 blur salt_pepper blur_gaussian)   # the summary's order
ORDER=("${ALL[@]}")
[ $# -gt 0 ] && ORDER=("$@")
for row in "${ORDER[@]}"; do
  [ -n "${ROWS[$row]:-}" ] || { echo "unknown row $row; rows: ${!ROWS[*]}" >&2; exit 2; }
  mkdir -p "$DEST/$row"
  # shellcheck disable=SC2086  # the row's --set options are split on purpose
  spark-submit --properties-file conf/spark/local.conf jobs/superres.py \
      --config conf/jobs/superres-sweep.toml ${ROWS[$row]} ${EXTRA:-} \
      --set "run.out_dir='$SCRATCH/$row'" 2>&1 | tee "$DEST/$row/job.log" | grep -v "step "
  cp "$SCRATCH/$row"/superres-*.json "$DEST/$row/job.json"
  cp "$SCRATCH/$row"/report/report.{json,md} "$DEST/$row/"
done
python - "$DEST" "${ALL[@]}" <<'PY'
import json, sys
from pathlib import Path
dest = Path(sys.argv[1])
lines = ["| degradation | bicubic (degraded LR) | conventional (stages apart) | "
         "thesis's conventional | cascade | cascade - thesis's conventional | "
         "SRCNN 2nd-layer units live (stages apart / thesis's / cascade) |",
         "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
for row in sys.argv[2:]:
    path = dest / row / "report.json"
    if not path.exists():
        continue
    rep = json.loads(path.read_text())
    avg, d = rep["average"], rep["degradation"]
    cell = lambda m: f"{avg[m]['psnr']:.2f} / {avg[m]['ssim']:.3f}" if m in avg else "-"
    gain = avg["cascade"]["psnr"] - avg["thesis_conventional"]["psnr"] \
        if "thesis_conventional" in avg else float("nan")
    label = {"gaussian": f"Gaussian sigma {d['sigma']:g}", "blur": f"blur {d['blur']:g}",
             "salt_pepper": f"salt-and-pepper {d['amount']:g}",
             "blur+gaussian": f"blur {d['blur']:g} + Gaussian {d['sigma']:g}"}[d["kind"]]
    job = json.loads((dest / row / "job.json").read_text())
    live = job.get("srcnn_active_units", {})       # [active, units] per ReLU layer
    units = " / ".join(f"{live[m][1][0]}/{live[m][1][1]}" if m in live else "-"
                       for m in ("conventional", "thesis_conventional", "cascade"))
    lines.append(f"| {label} | {cell('bicubic')} | {cell('conventional')} | "
                 f"{cell('thesis_conventional')} | {cell('cascade')} | {gain:+.2f} dB | "
                 f"{units} |")
(dest / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
