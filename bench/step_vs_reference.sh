#!/usr/bin/env bash
# Eyas's training step against the field's reference trainer (SpecForge v0.2.0), side by side in one device call
# (issue 13). Needs the fetched reference under .ref/SpecForge (bench/reference_step.py says how); carry .ref.
#   here:    bench/step_vs_reference.sh ref GITDIR   the reference at v0.2.0 into .ref/SpecForge from a clone of
#            github.com/sgl-project/SpecForge (on these machines, the search library's `fetch` gives one)
#   device:  bench/step_vs_reference.sh gpu      (carry: .ref; results and the table in $OUT)
#            bench/step_vs_reference.sh gpu-fp8  Eyas's step with train.fp8 (tensorwise, rowwise): carry .whl with
#                                                torchao's wheel, installed to /root/site (PYTHONPATH)
#            bench/step_vs_reference.sh gpu-8k   the 8K line in one call (carry .ref and .whl): the reference, Eyas
#                                                bf16, Eyas with train.fp8 tensorwise + train.fp8_lm_head, at 8,192
#            bench/step_vs_reference.sh gpu-batch  2,048-token samples, batch raised on both sides (REF_BATCHES,
#                                                EYAS_BATCHES): the equal-memory table and its line
#            (each part writes its JSON under $OUT; the report joins the parts present there)
#   here:    bench/step_vs_reference.sh report DIR   the table and lines over the parts' JSON files gathered in DIR
#   here:    bench/step_vs_reference.sh cpu      the same commands at the tiny shape (checks the scripts), and
#            bench/reference_step.py agree: Eyas's TTT against the reference's on the same weights (fp32, CPU)
# Each trainer runs in its own process (no memory left over from the other); the reference first at each shape.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?mode: ref, gpu, gpu-8k, gpu-fp8, gpu-batch, cpu or report DIR}
PY=${PYTHON:-python3}
if [ "$mode" = ref ]; then
  GITDIR=${2:?a git directory of SpecForge}
  rm -rf .ref/SpecForge && mkdir -p .ref/SpecForge
  git --git-dir="$GITDIR" archive 73e6f808 specforge scripts/train_eagle3.py LICENSE | tar -x -C .ref/SpecForge
  echo "reference (SpecForge 73e6f808, v0.2.0) in .ref/SpecForge: $(du -sh .ref/SpecForge | cut -f1)"
  exit 0
fi
O=${OUT:-/tmp/step_vs_reference}
[ "$mode" = report ] && O=${2:?report DIR: a folder holding the JSON files of the parts}
mkdir -p "$O"
if [ "$mode" = report ]; then
  :   # only the report below, over the parts gathered in DIR
elif [ "$mode" = gpu ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$O/gpu.txt"
  git rev-parse --short HEAD 2>/dev/null | tee "$O/commit.txt" || true
  COMMON="--iters ${ITERS:-8} --warmup 3"
  $PY bench/reference_step.py --shape llama31-8b --seq 2048 8192 $COMMON --budget-s 240 --out "$O/ref_llama.json"
  $PY bench/train_step.py --shape llama31-8b --seq 2048 8192 --attention flex --compile layer $COMMON \
    --budget-s 240 --out "$O/eyas_llama.json"
  $PY bench/reference_step.py --shape kimi-k2 --seq 2048 $COMMON --out "$O/ref_kimi.json"
  $PY bench/train_step.py --shape kimi-k2 --seq 2048 --attention flex --compile layer $COMMON --out "$O/eyas_kimi.json"
elif [ "$mode" = gpu-fp8 ]; then   # issue 20: fp8 rows beside the bf16 ones (train.fp8; torchao carried in .whl)
  COMMON="--iters ${ITERS:-8} --warmup 3"
  $PY bench/train_step.py --shape llama31-8b --seq 2048 8192 --attention flex --compile layer --fp8 tensorwise rowwise \
    $COMMON --budget-s 300 --out "$O/eyas_llama_fp8.json"
  $PY bench/train_step.py --shape kimi-k2 --seq 2048 --attention flex --compile layer --fp8 tensorwise rowwise \
    $COMMON --out "$O/eyas_kimi_fp8.json"
elif [ "$mode" = gpu-8k ]; then   # issue 20's 8K line measured side by side (the 2026-12-04 row was not)
  COMMON="--iters ${ITERS:-5} --warmup 2"
  $PY bench/reference_step.py --shape llama31-8b --seq 8192 $COMMON --out "$O/ref_llama.json"
  $PY bench/train_step.py --shape llama31-8b --seq 8192 --attention flex --compile layer $COMMON \
    --out "$O/eyas_llama.json"
  $PY bench/train_step.py --shape llama31-8b --seq 8192 --attention flex --compile layer --fp8 tensorwise \
    --fp8-lm-head on $COMMON --out "$O/eyas_llama_fp8.json"
elif [ "$mode" = gpu-batch ]; then   # issue 20: 2,048-token samples, each trainer's batch raised (equal memory)
  COMMON="--iters ${ITERS:-5} --warmup 2"
  $PY bench/reference_step.py --shape llama31-8b kimi-k2 --seq 2048 --batch ${REF_BATCHES:-2 4 8} $COMMON \
    --budget-s 300 --out "$O/ref_batch.json"
  $PY bench/train_step.py --shape llama31-8b kimi-k2 --seq 2048 --batch ${EYAS_BATCHES:-2 4 8} --fp8 off tensorwise \
    --attention flex --compile layer $COMMON --budget-s 300 --out "$O/eyas_batch.json"
else
  COMMON="--iters 2 --warmup 1 --device cpu --tiny"
  $PY bench/reference_step.py --seq 64 128 --batch 1 2 $COMMON --out "$O/ref_llama.json"
  $PY bench/train_step.py --seq 64 128 --batch 1 2 --fp8 off tensorwise --attention sdpa $COMMON \
    --out "$O/eyas_llama.json"   # fp8 falls back on a CPU (the row says so)
  echo '{"rows": []}' > "$O/ref_kimi.json"; echo '{"rows": []}' > "$O/eyas_kimi.json"
  $PY bench/reference_step.py agree | tee "$O/agree.json"   # Eyas's TTT against the reference's, same weights
fi
$PY - "$O" <<'PY'
import json, sys
from pathlib import Path
o = Path(sys.argv[1])
for who in ("ref", "eyas"):   # one file per trainer for the report: every part that ran (gpu, gpu-fp8, gpu-batch)
    parts = [o / f"{who}_{s}.json" for s in ("llama", "kimi", "llama_fp8", "kimi_fp8", "batch")]
    rows = [r for p in parts if p.exists() for r in json.loads(p.read_text())["rows"]]
    (o / f"{who}.json").write_text(json.dumps({"rows": rows}, indent=1))
PY
$PY bench/reference_step.py report --eyas "$O/eyas.json" --ref "$O/ref.json" | tee "$O/table.md"
