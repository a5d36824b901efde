"""One full EAGLE-3 training step of a Llama-3.1-8B-shaped draft: tokens/s, MFU and peak memory.

The step (as the issue and BENCHMARKS.md define it): soft labels from the target lm_head on the stored post-norm
last hidden state, K TTT steps of the draft, the loss, backward, gradient clipping and an AdamW step. Inputs are
already on the device, weights random, batch 1, bf16 autocast over fp32 master weights.

Imports only ``eyas.model`` and ``eyas.train.loss`` (torch + transformers' RoPE tables), so it runs in an image
without the rest of Eyas's dependencies.

    python bench/train_step.py --seq 2048 8192 32768 --attention flex --out results.json
    python bench/train_step.py --tiny --device cpu --attention sdpa   # seconds: checks the script itself

FLOPs counted per token (the issue's convention): 6 x the trainable parameters each token touches (fc once; the
decoder layer, MLP and draft lm_head once per TTT step) plus attention, 3 x 4 x (keys seen) x nh x hd per step
(keys seen = (T+1)/2 causal + k diagonal), per decoder layer (``--layers``: train.draft.num_hidden_layers). The
target lm_head (no gradient) is not counted.
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

from eyas.model.eagle3 import Eagle3Config, Eagle3DraftModel  # noqa: E402
from eyas.train.fp8 import apply_fp8_training, fp8_lm_head_unavailable  # noqa: E402
from eyas.train.loss import target_labels, ttt_loss_fused  # noqa: E402

LLAMA31_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=128, target_hidden_size=4096, vocab_size=128256, draft_vocab_size=32000,
                  rms_norm_eps=1e-5, max_position_embeddings=131072,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192})
TINY = dict(hidden_size=64, intermediate_size=150, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            target_hidden_size=64, vocab_size=999, draft_vocab_size=301, max_position_embeddings=4096)


def flops_per_token(cfg: Eagle3Config, T: int, K: int) -> tuple[float, float]:
    """(dense, attention) training FLOPs per token of one step (forward + backward: 6 per weight, 3x the
    forward's 4 per attended key and head dim). midlayer's q/k/v read 2H (embedding and feature), each of the
    ``num_hidden_layers - 1`` stacked layers' read H; every layer attends over its own keys."""
    H, I, Ht = cfg.hidden_size, cfg.intermediate_size, cfg.target_hidden_size
    qkv_width = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    o_and_mlp = cfg.num_attention_heads * cfg.head_dim * H + 3 * H * I
    L = cfg.num_hidden_layers
    per_step = 2 * H * qkv_width + o_and_mlp + (L - 1) * (H * qkv_width + o_and_mlp) + cfg.draft_vocab_size * H
    dense = 6 * (cfg.num_aux_layers * Ht * H + K * per_step)
    attn = L * sum(3 * 4 * ((T + 1) / 2 + k) * cfg.num_attention_heads * cfg.head_dim for k in range(K))
    return float(dense), float(attn)


def build(cfg: Eagle3Config, T: int, device: torch.device, attention: str, seed: int = 0,
          param_dtype: str = "fp32", batch: int = 1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    model = Eagle3DraftModel(cfg)
    if param_dtype == "bf16":   # no fp32 master weights: the bound set by the master-weight traffic
        model.to(torch.bfloat16)
    model.embed_tokens.weight.data = model.embed_tokens.weight.data.to(torch.bfloat16)
    draft_ids = torch.randperm(cfg.vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values
    with torch.no_grad():
        model.d2t.copy_(draft_ids - torch.arange(cfg.draft_vocab_size))
        model.t2d.zero_()
        model.t2d[draft_ids] = True
    model.to(device).train()
    model.set_attention(attention)
    data = {
        "ids": torch.randint(0, cfg.vocab_size, (batch, T), generator=g).to(device),
        "aux": torch.randn(batch, T, cfg.num_aux_layers * cfg.target_hidden_size, generator=g).to(device,
                                                                                                torch.bfloat16),
        "last": torch.randn(batch, T, cfg.target_hidden_size, generator=g).to(device, torch.bfloat16),
        "mask": torch.ones(batch, T, dtype=torch.int64, device=device),
        "head": (torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=g) * 0.02).to(device, torch.bfloat16),
        "draft_ids": draft_ids.to(device),
    }
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    return model, data, params, opt


SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               target_hidden_size=576, vocab_size=49152, draft_vocab_size=32000, rms_norm_eps=1e-5,
               max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
# Kimi-K2's width and vocabulary (issue 13): hidden 7168, 64 query heads, vocabulary 163,840; the draft's own
# choices (no published EAGLE-3 Llama-layer config for it): 8 KV heads of 128 (as SpecForge's DeepSeek-V3 draft),
# intermediate 18,432 (Kimi-K2's dense MLP), default RoPE at its rope_theta 50,000.
KIMI_K2 = dict(hidden_size=7168, intermediate_size=18432, num_attention_heads=64, num_key_value_heads=8,
               head_dim=128, target_hidden_size=7168, vocab_size=163840, draft_vocab_size=32000, rms_norm_eps=1e-5,
               max_position_embeddings=131072, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
SHAPES = {"llama31-8b": LLAMA31_8B, "kimi-k2": KIMI_K2, "smollm2": SMOLLM2, "tiny": TINY}


def make_step(model, data, params, opt, K: int, device: torch.device, loss_chunk: int, compiled: bool,
              fp8_lm_head: bool = False):
    def step():
        labels = target_labels(data["last"], data["head"], data["draft_ids"], model.t2d, data["mask"])
        with torch.autocast(device.type, dtype=torch.bfloat16):
            hiddens = model(data["ids"], data["aux"], K)
            loss, metrics = ttt_loss_fused(hiddens, model.norm, model.lm_head.weight, labels, 0.8, chunk=loss_chunk,
                                            compiled=compiled, fp8=fp8_lm_head)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach(), gn
    return step


def warm_and_time(step, device: torch.device, warmup: int, iters: int) -> tuple[object, float, list[float]]:
    """Run ``step()`` ``warmup`` times, then time it ``iters`` times (CUDA events on a GPU, the wall clock on a CPU;
    peak-memory statistics reset between). Returns (the last warm-up step's output, warm-up seconds, step seconds
    sorted ascending)."""
    t0 = time.time()
    out = None
    for _ in range(warmup):
        out = step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    warm_s = time.time() - t0
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
    return out, warm_s, sorted(times)


def peak_memory(device: torch.device) -> dict:
    """``peak_gb``: the GPU's allocated peak since the last reset; on a CPU ``peak_rss_gb``, the process's peak
    resident memory (one configuration per process to read it as that configuration's)."""
    if device.type == "cuda":
        return {"peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2)}
    import resource

    return {"peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)}


def measure(cfg: Eagle3Config, T: int, K: int, device: torch.device, attention: str, compile_layer: bool,
            warmup: int, iters: int, loss_chunk: int, param_dtype: str = "fp32", profile: Path | None = None,
            batch: int = 1, shape_name: str = "", fp8: str = "off", fp8_lm_head: bool = False) -> dict:
    model, data, params, opt = build(cfg, T, device, attention, param_dtype=param_dtype, batch=batch)
    # train.fp8: the draft's linear layers through torchao's float8 training (before compile, as the loop does);
    # on a CPU or an older GPU it falls back and the row says so
    conv = apply_fp8_training(model, fp8, device, log=lambda m: print(m, flush=True))
    if compile_layer:  # norms, RoPE, MLP elementwise and the loss's per-chunk work through torch.compile
        model.compile_ttt()
    # train.fp8_lm_head: the lm_head's products in the fused loss through torch._scaled_mm (the loop's rule: fp8
    # tensor cores, sizes multiples of 16; elsewhere the row says why it was not used)
    head_why = fp8_lm_head_unavailable(device, tuple(model.lm_head.weight.shape)) if fp8_lm_head else None
    if head_why:
        print(f"fp8 lm_head not used: {head_why}", flush=True)
    head_fp8 = fp8_lm_head and head_why is None
    step = make_step(model, data, params, opt, K, device, loss_chunk, compile_layer, head_fp8)
    (loss, gn), warm_s, times = warm_and_time(step, device, warmup, iters)
    if profile is not None and device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile as prof

        with prof(activities=[ProfilerActivity.CUDA]) as pr:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        table = pr.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
        profile.write_text(table)
        print(table, flush=True)
    if not (math.isfinite(float(loss)) and math.isfinite(float(gn))):
        raise RuntimeError(f"non-finite loss {float(loss)} / grad norm {float(gn)}")
    med = times[len(times) // 2]
    dense, attn = flops_per_token(cfg, T, K)
    out = {"shape": shape_name, "seq": T, "batch": batch, "ttt_steps": K, "layers": cfg.num_hidden_layers,
           "attention": attention,
           "compile_layer": compile_layer, "fp8": conv.recipe, **({"fp8_fallback": conv.fallback} if conv.fallback
                                                                  else {}),
           "fp8_lm_head": head_fp8,
           "param_dtype": param_dtype, "loss_chunk": loss_chunk,
           "step_ms": round(med * 1e3, 2), "step_ms_min": round(times[0] * 1e3, 2),
           "tokens_per_s": round(batch * T / med, 1), "tflops_per_s": round(batch * T * (dense + attn) / med / 1e12, 1),
           "dense_gflop_per_token": round(dense / 1e9, 2), "attention_gflop_per_token": round(attn / 1e9, 3),
           "warmup_s": round(warm_s, 1), "iters": iters, "loss": round(float(loss), 4), **peak_memory(device)}
    del model, data, params, opt, step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def matmul_tflops(device: torch.device) -> float:
    """Measured bf16 8192^3 matrix-product rate (the MFU denominator), median of 10 after 3 warm-ups."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        a @ b
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    return 2 * 8192 ** 3 / sorted(ts)[5] / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", nargs="+", default=["llama31-8b"], choices=sorted(SHAPES), help="draft shapes")
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--attention", nargs="+", default=["flex"], help="ATTENTION backends to time")
    ap.add_argument("--compile", choices=["none", "layer", "both"], default="none")
    ap.add_argument("--loss-chunk", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny odd shape (checks the script, not the speed)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip configurations once this much time passed")
    ap.add_argument("--param-dtype", nargs="+", default=["fp32"], choices=["fp32", "bf16"],
                    help="fp32 master weights + bf16 autocast (default), or bf16 weights")
    ap.add_argument("--fp8", nargs="+", default=["off"], choices=["off", "tensorwise", "rowwise"],
                    help="train.fp8 settings to time (fp8 products in the draft's linear layers, torchao)")
    ap.add_argument("--fp8-lm-head", nargs="+", default=["off"], choices=["off", "on"],
                    help="train.fp8_lm_head settings to time (the draft lm_head's products in fp8 in the fused loss)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1],
                    help="sequences a step (each --seq long): Eyas's token budget is batch x seq")
    ap.add_argument("--layers", type=int, nargs="+", default=[1],
                    help="train.draft.num_hidden_layers settings to time (decoder layers of the draft)")
    ap.add_argument("--profile", type=Path, help="write a CUDA kernel table of 2 steps of the first configuration")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    device = torch.device(args.device)
    peak = matmul_tflops(device) if device.type == "cuda" else float("nan")
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), torch "
          f"{torch.__version__}, measured bf16 matmul {peak:.0f} TFLOP/s", flush=True)
    compiles = {"none": [False], "layer": [True], "both": [False, True]}[args.compile]
    rows, t0 = [], time.time()
    shapes = ["tiny"] if args.tiny else args.shape
    combos = [(s, a, c, pd, f8, b, hd == "on", nl) for s in shapes for a in args.attention for c in compiles
              for pd in args.param_dtype for f8 in args.fp8 for b in args.batch for hd in args.fp8_lm_head
              for nl in args.layers]
    for shape, attention, comp, pdt, f8, bsz, head8, layers in combos:
        cfg = Eagle3Config(**SHAPES[shape], num_hidden_layers=layers)
        for T in args.seq:
            if attention == "sdpa" and T > 8192:
                continue  # the SDPA backend's dense [T, K*T] mask is meant for short sequences
            if time.time() - t0 > args.budget_s:
                print(f"skip {attention} compile={comp} T={T}: time budget spent", flush=True)
                continue
            try:
                r = measure(cfg, T, args.ttt, device, attention, comp, args.warmup, args.iters, args.loss_chunk,
                            pdt, args.profile if not rows else None, batch=bsz, shape_name=shape, fp8=f8,
                            fp8_lm_head=head8)
            except Exception as e:  # an OOM or a compile failure is a result too
                r = {"shape": shape, "seq": T, "batch": bsz, "layers": layers, "fp8": f8, "fp8_lm_head": head8,
                     "attention": attention, "compile_layer": comp,
                     "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            r["mfu_vs_790"] = round(r["tflops_per_s"] / 790, 3) if "tflops_per_s" in r else None
            r["mfu_vs_measured"] = round(r["tflops_per_s"] / peak, 3) if "tflops_per_s" in r else None
            rows.append(r)
            print(json.dumps(r), flush=True)
            if args.out:
                args.out.write_text(json.dumps({"peak_tflops": peak, "rows": rows}, indent=1))
    print("\nattention compile fp8        head8 params   seq batch layers  step_ms  tokens/s  TFLOP/s  MFU(790)  "
          "peak_GB")
    for r in rows:
        if "error" in r:
            print(f"{r['attention']:9} {str(r['compile_layer']):7} {r['fp8']:10} {r['seq']:6} {r['batch']:3} "
                  f"{r['layers']:2}  ERROR "
                  f"{r['error'][:80]}")
        else:
            print(f"{r['attention']:9} {str(r['compile_layer']):7} {r['fp8']:10} {str(r.get('fp8_lm_head', False)):5} "
                  f"{r['param_dtype']:6} {r['seq']:6} "
                  f"{r['batch']:5} {r['layers']:6} "
                  f"{r['step_ms']:9.1f} {r['tokens_per_s']:9.0f} {r['tflops_per_s']:8.1f} {r['mfu_vs_790']:9.3f} "
                  f"{r.get('peak_gb', float('nan')):8.2f}")


if __name__ == "__main__":
    main()
