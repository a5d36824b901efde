#!/usr/bin/env bash
# Two GPUs against one (issue 15), every step in one device call on nvidia-h200-x2 (bench/two_gpu.py says what each
# figure is). NCCL over the GPUs' own link, NVLink multicast left off (NCCL_NVLS_ENABLE=0: the device's KINDS.md).
#   here, once:  bench/two_gpu.sh parts       the stories260K tokenizer and the data under .gpu/, the wheels in .whl/
#   device:      bench/two_gpu.sh gpu-train     (carry: .whl; results in $OUT), then at once
#                bench/two_gpu.sh gpu-extract   (carry: .gpu/stories .gpu/hdata.tar.xz .whl)
#   here:        bench/two_gpu.sh cpu-check   every step at a tiny scale, 2 gloo processes on the CPU
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:?step}
PY=${PYTHON:-python3}
B="$PY bench/two_gpu.py"
TR="$PY -m torch.distributed.run --nproc-per-node 2 --master-port 29517"

run_train() {  # work dir, device (cuda|cpu), draft shape, tokens per sequence, timed steps
  local D=$1 DEV=$2 SHAPE=$3 SEQ=$4 ITERS=$5
  rm -rf "$D" && mkdir -p "$D"
  # training: 1 process x B, 1 process x 2B (the loss reference), 2 processes x B (FSDP2), 2 processes killed + resumed
  $B store --dir "$D" --shape $SHAPE --seq $SEQ --samples 64
  $B train --dir "$D" --shape $SHAPE --seq $SEQ --batch 1 --tag one --iters $ITERS --device $DEV
  $B train --dir "$D" --shape $SHAPE --seq $SEQ --batch 2 --tag one_b2 --iters $ITERS --device $DEV
  $TR bench/two_gpu.py train --dir "$D" --shape $SHAPE --seq $SEQ --batch 1 --tag two --iters $ITERS --device $DEV \
    --checkpoint-every 4
  $B kill --when "$D/killed/checkpoints/step-00000008/state.json" --log "$D/killed_1.log" -- \
    $TR bench/two_gpu.py train --dir "$D" --shape $SHAPE --seq $SEQ --batch 1 --tag killed --iters $ITERS \
    --device $DEV --checkpoint-every 4
  $TR bench/two_gpu.py train --dir "$D" --shape $SHAPE --seq $SEQ --batch 1 --tag killed --iters $ITERS \
    --device $DEV --checkpoint-every 4 > "$D/killed_2.log" 2>&1
  $B compare-weights --dir "$D" --a two --b killed || echo "WEIGHTS DIFFER"
  $B report --dir "$D"
}

run_extract() {  # work dir, device, tokenizer folder, conversations, max tokens per sample
  local D=$1 DEV=$2 TGT=$3 MAXS=$4 MAXLEN=$5
  rm -rf "$D/extract_runs" "$D/target" && mkdir -p "$D/extract_runs"
  # extraction: one tokenized run, extracted by 1 process (x1), 2 processes (x2), 2 processes killed + resumed (x3)
  $B target --tokenizer-from "$TGT" --out "$D/target" ${TARGET_SIZE:-}
  local R=$D/extract_runs
  cat > "$R/x1.yaml" <<YAML
run_dir: $R/x1
target: {model: $D/target, dtype: bfloat16, device: $DEV}
prepare:
  max_samples: $MAXS
  sources:
    - {path: .hdata/train/sharegpt_multiturn.jsonl}
    - {path: .hdata/train/gsm8k_train.jsonl}
    - {path: .hdata/train/alpaca_en_demo.json}
generate: {enabled: false}
tokenize: {max_length: $MAXLEN}
extract: {batch_tokens: ${BATCH_TOKENS:-65536}}
YAML
  $PY -m eyas.cli prepare "$R/x1.yaml" > "$R/prepare.log" 2>&1
  for s in generate tokenize; do $PY -m eyas.cli $s "$R/x1.yaml" > "$R/$s.log" 2>&1; done
  for x in x2 x3; do
    cp -r "$R/x1" "$R/$x" && sed "s#run_dir: $R/x1#run_dir: $R/$x#" "$R/x1.yaml" > "$R/$x.yaml"
  done
  $PY -m eyas.cli extract "$R/x1.yaml" > "$R/x1.log" 2>&1
  $TR -m eyas.cli extract "$R/x2.yaml" > "$R/x2.log" 2>&1
  $B compare-stores --a "$R/x1/extract/store" --b "$R/x2/extract/store" --out "$D/stores_x1_x2.json" || echo "STORES DIFFER"
  $PY -m eyas.cli doctor "$R/x2" | tail -3
  $B kill --when "$R/x3/extract/store/manifest/rank-001.jsonl" --lines 1 --log "$R/x3_1.log" -- $TR -m eyas.cli extract "$R/x3.yaml"
  $TR -m eyas.cli extract "$R/x3.yaml" > "$R/x3_2.log" 2>&1
  $B compare-stores --a "$R/x1/extract/store" --b "$R/x3/extract/store" --out "$D/stores_x1_x3.json" || echo "STORES DIFFER"
  $B report --dir "$D"
}

case $step in
  parts)
    mkdir -p .gpu/stories
    $PY -c "import sys; sys.path.insert(0, 'src'); from pathlib import Path; from eyas.targets.llama2c import convert_llama2c; \
S = Path('../shared/models/stories260K'); convert_llama2c(S / 'stories260K.bin', S / 'tok512.bin', Path('.gpu/stories'))"
    [ -f .gpu/hdata.tar.xz ] || tar cJf .gpu/hdata.tar.xz -C .. shared/data --transform 's,^shared/,,'
    [ -n "$(ls .whl 2>/dev/null)" ] || bench/headline.sh parts
    ls -la .gpu/stories .gpu/hdata.tar.xz .whl ;;
  gpu-train)    # one device call: training, 1 vs 2 GPUs, loss check, kill + resume (~6 min: five compiled runs)
    export PYTHONPATH=$PWD/src:/root/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TQDM_MININTERVAL=20
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nvidia-smi topo -m | head -4
    run_train /dev/shm/two cuda llama31_8b 2048 ${2:-24} 2>&1 | tee "$OUT/two_gpu_train.log" | grep -v '^train:' | tail -30
    cp /dev/shm/two/*.json "$OUT/" 2>/dev/null || true ;;
  gpu-extract)  # the next call, while the machine is warm: extraction, 1 vs 2 GPUs, stores compared, kill + resume
    export PYTHONPATH=$PWD/src:/root/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TQDM_MININTERVAL=20
    [ -d /root/site/pydantic ] || $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /root/site .whl/*.whl
    mkdir -p /root/data && tar xJf .gpu/hdata.tar.xz -C /root && ln -sfn /root/data .hdata
    run_extract /dev/shm/two cuda .gpu/stories ${2:-4000} 2048 2>&1 | tee "$OUT/two_gpu_extract.log" | tail -20
    cp /dev/shm/two/*.json "$OUT/" 2>/dev/null || true ;;
  cpu-check)
    export PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 TARGET_SIZE="--hidden 64 --intermediate 128 --layers 8 --heads 4 --kv-heads 2" \
      BATCH_TOKENS=400
    [ -d .gpu/stories ] || bench/two_gpu.sh parts
    [ -e .hdata ] || ln -sfn ../shared/data .hdata
    run_train /tmp/two_gpu_check cpu tiny 96 12
    run_extract /tmp/two_gpu_check cpu .gpu/stories 60 96 ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
