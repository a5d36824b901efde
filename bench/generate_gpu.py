"""Generation throughput on a GPU: the generate stage's engine (eyas.generation.engine.SlotEngine) against
transformers' ``generate`` with its dynamic cache, in one process, random weights in a real target's shape.

    python bench/generate_gpu.py --shape smollm2 --out generate_gpu.json

Rows (greedy, no end token, so every reply has exactly ``--new-tokens`` tokens and the counts are equal):
- ``hf_dynamic``: ``model.generate`` at batch ``--hf-batch`` on fixed-length prompts (issue 11's probe: 256-token
  prompts, batch 512: 22,200 new tokens/s on the H200), the baseline measured in the same run;
- ``engine``: SlotEngine with ``--slots`` slots on the same fixed-length prompts, and on prompts whose lengths
  follow a ShareGPT-like log-normal (median 250 tokens, 16..1,536), where its refilling and per-row attention
  matter. Each row reports new tokens/s, decode steps and the engine's attention/graph path.
A check first: the engine (CUDA graph + Triton attention) against the engine eager with SDPA attention, the share
of equal tokens (bf16).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eyas.generation.engine import GenRequest, SlotEngine  # noqa: E402

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    tie_word_embeddings=True, rms_norm_eps=1e-5),
    "tiny": dict(hidden_size=64, intermediate_size=129, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=301, max_position_embeddings=2048, tie_word_embeddings=False),
}


def build(shape: str, device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPES[shape])
    return LlamaForCausalLM(cfg).to(device, dtype).eval(), cfg


def prompts_fixed(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


def prompts_lognormal(n: int, vocab: int, seed: int = 1, median: float = 250, lo: int = 16, hi: int = 1536):
    g = torch.Generator().manual_seed(seed)
    lens = (torch.randn(n, generator=g) * 0.9 + math.log(median)).exp().clamp(lo, hi).long().tolist()
    return [torch.randint(10, vocab, (L,), generator=g).tolist() for L in lens]


def run_engine(model, prompts, new_tokens: int, slots: int, **kw) -> dict:
    eng = SlotEngine(model, slots=slots, cache_len=max(map(len, prompts)) + new_tokens, max_new_tokens=new_tokens,
                     eos_ids=[], log=lambda m: print(m, flush=True), **kw)
    q = [GenRequest(i, p, new_tokens) for i, p in enumerate(prompts)]
    got = {}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    st = eng.run(lambda n: [q.pop() for _ in range(min(n, len(q)))], lambda r: got.__setitem__(r.key, r.token_ids))
    torch.cuda.synchronize()
    sec = time.perf_counter() - t0
    assert len(got) == len(prompts) and all(len(v) == new_tokens for v in got.values())
    out = {"prompts": len(prompts), "slots": st.slots, "new_tokens": st.new_tokens, "seconds": round(sec, 3),
           "new_tokens_per_s": round(st.new_tokens / sec, 1), "decode_steps": st.decode_steps,
           "prefill_tokens": st.prefill_tokens, "attention": st.attention, "cuda_graph": st.cuda_graph,
           "notes": st.notes}
    del eng
    torch.cuda.empty_cache()
    return out, got


def run_hf(model, prompts, new_tokens: int, batch: int) -> dict:
    model.generation_config.min_new_tokens = new_tokens
    n = 0
    ids_all = torch.tensor(prompts, device="cuda")
    model.generate(ids_all[:batch], max_new_tokens=4, do_sample=False, pad_token_id=0)   # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in range(0, len(prompts), batch):
        out = model.generate(ids_all[b: b + batch], max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
        n += (out.shape[1] - ids_all.shape[1]) * out.shape[0]
    torch.cuda.synchronize()
    sec = time.perf_counter() - t0
    return {"prompts": len(prompts), "batch": batch, "new_tokens": n, "seconds": round(sec, 3),
            "new_tokens_per_s": round(n / sec, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="smollm2", choices=list(SHAPES))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=512)
    ap.add_argument("--slots", type=int, nargs="+", default=[512, 1024, 1536])
    ap.add_argument("--prompts", type=int, default=4096)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    model, cfg = build(args.shape, "cuda", torch.bfloat16)
    V = cfg.vocab_size
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape,
           "new_tokens_per_prompt": args.new_tokens, "rows": []}

    def save():
        if args.out:
            args.out.write_text(json.dumps(res, indent=1))

    # check: graph + Triton against eager + SDPA on the same prompts
    chk = prompts_lognormal(96, V, seed=5, hi=700)
    a, fast = run_engine(model, chk, 64, 32)
    b, slow = run_engine(model, chk, 64, 32, attention="sdpa", cuda_graph=False)
    same = sum(x == y for i in fast for x, y in zip(fast[i], slow[i])) / sum(len(v) for v in slow.values())
    res["check"] = {"fast": a, "eager_sdpa": b, "equal_token_share": round(same, 4)}
    print(json.dumps(res["check"]), flush=True)
    save()
    fixed = prompts_fixed(args.prompts, 256, V)
    r = run_hf(model, fixed[: args.hf_batch * 2], args.new_tokens, args.hf_batch)
    res["rows"].append({"what": "hf_dynamic", "prompt_len": 256, **r})
    print(json.dumps(res["rows"][-1]), flush=True)
    save()
    for slots in args.slots:
        r, _ = run_engine(model, fixed, args.new_tokens, slots)
        res["rows"].append({"what": "engine", "prompt_len": 256, **r})
        print(json.dumps(res["rows"][-1]), flush=True)
        save()
    varied = prompts_lognormal(args.prompts, V)
    for slots in args.slots[-2:]:
        r, _ = run_engine(model, varied, args.new_tokens, slots)
        res["rows"].append({"what": "engine", "prompt_len": "lognormal 250", **r})
        print(json.dumps(res["rows"][-1]), flush=True)
        save()
    base = res["rows"][0]["new_tokens_per_s"]
    print("\nwhat        prompts        slots/batch  new tok/s   x hf_dynamic  attention  graph")
    for r in res["rows"]:
        print(f"{r['what']:11} {str(r['prompt_len']):14} {r.get('slots', r.get('batch')):11} "
              f"{r['new_tokens_per_s']:10.0f} {r['new_tokens_per_s'] / base:8.2f}     {r.get('attention', '-'):9} "
              f"{r.get('cuda_graph', '-')}")


if __name__ == "__main__":
    main()
