#!/usr/bin/env bash
# Eyas's training step against the field's reference trainer (SpecForge v0.2.0), side by side in one device call
# (issue 13). Needs the fetched reference under .ref/SpecForge (bench/reference_step.py says how); carry .ref.
#   here:    bench/step_vs_reference.sh ref GITDIR   the reference at v0.2.0 into .ref/SpecForge from a clone of
#            github.com/sgl-project/SpecForge (on these machines, the search library's `fetch` gives one)
#   device:  bench/step_vs_reference.sh gpu      (carry: .ref; results and the table in $OUT)
#   here:    bench/step_vs_reference.sh cpu      the same commands at the tiny shape (checks the scripts), and
#            bench/reference_step.py agree: Eyas's TTT against the reference's on the same weights (fp32, CPU)
# Each trainer runs in its own process (no memory left over from the other); the reference first at each shape.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?mode: ref, gpu or cpu}
PY=${PYTHON:-python3}
if [ "$mode" = ref ]; then
  GITDIR=${2:?a git directory of SpecForge}
  rm -rf .ref/SpecForge && mkdir -p .ref/SpecForge
  git --git-dir="$GITDIR" archive 73e6f808 specforge scripts/train_eagle3.py LICENSE | tar -x -C .ref/SpecForge
  echo "reference (SpecForge 73e6f808, v0.2.0) in .ref/SpecForge: $(du -sh .ref/SpecForge | cut -f1)"
  exit 0
fi
O=${OUT:-/tmp/step_vs_reference}
mkdir -p "$O"
if [ "$mode" = gpu ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$O/gpu.txt"
  git rev-parse --short HEAD 2>/dev/null | tee "$O/commit.txt" || true
  COMMON="--iters ${ITERS:-8} --warmup 3"
  $PY bench/reference_step.py --shape llama31-8b --seq 2048 8192 $COMMON --budget-s 240 --out "$O/ref_llama.json"
  $PY bench/train_step.py --shape llama31-8b --seq 2048 8192 --attention flex --compile layer $COMMON \
    --budget-s 240 --out "$O/eyas_llama.json"
  $PY bench/reference_step.py --shape kimi-k2 --seq 2048 $COMMON --out "$O/ref_kimi.json"
  $PY bench/train_step.py --shape kimi-k2 --seq 2048 --attention flex --compile layer $COMMON --out "$O/eyas_kimi.json"
else
  COMMON="--iters 2 --warmup 1 --device cpu --tiny"
  $PY bench/reference_step.py --seq 64 128 $COMMON --out "$O/ref_llama.json"
  $PY bench/train_step.py --seq 64 128 --attention sdpa $COMMON --out "$O/eyas_llama.json"
  echo '{"rows": []}' > "$O/ref_kimi.json"; echo '{"rows": []}' > "$O/eyas_kimi.json"
  $PY bench/reference_step.py agree | tee "$O/agree.json"   # Eyas's TTT against the reference's, same weights
fi
$PY - "$O" <<'PY'
import json, sys
from pathlib import Path
o = Path(sys.argv[1])
for who in ("ref", "eyas"):   # one file per trainer for the report
    rows = [r for s in ("llama", "kimi") for r in json.loads((o / f"{who}_{s}.json").read_text())["rows"]]
    (o / f"{who}.json").write_text(json.dumps({"rows": rows}, indent=1))
PY
$PY bench/reference_step.py report --eyas "$O/eyas.json" --ref "$O/ref.json" | tee "$O/table.md"
