"""The training loop against its own step: in-loop tokens/s of ``eyas.train.loop.train`` over a real hidden-state
store on disk, and ``bench/train_step.py``'s step alone on the same draft shape, batch and tokens per step, in one
process (so one device call measures both).

    python bench/train_loop.py --shapes smollm2 llama31_8b --store-dir /root/bench-store --out train_loop.json
    python bench/train_loop.py --tiny --device cpu --attention sdpa   # a check of the script itself

In-loop: the store is written with Eyas's own :class:`~eyas.store.shards.ShardWriter` (random bf16 states, random
token ids, fixed-length samples so both sides see the same [B, T] batches), read back through
:class:`~eyas.train.data.SampleDataset` by the loop's DataLoader workers, with everything the loop does per step
(batches made and copied ahead, soft labels, TTT forward and fused loss, backward, clipping, AdamW, metrics with
one host transfer, ``metrics.jsonl``). The figure is the median of the loop's own per-step rate
(``recent_tokens_per_s``: real tokens of the step over the wall time since the previous step) after the warm-up
steps (compilation). Step alone: :func:`train_step.measure` with ``batch`` = B (CUDA events, median). Both use
compiled layer parts and loss chunks, bf16 autocast over fp32 master weights, fused AdamW and the same attention
kernel. ``ratio = in-loop / step``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import train_step  # noqa: E402

from eyas.config import TrainConfig  # noqa: E402
from eyas.model.eagle3 import Eagle3Config  # noqa: E402
from eyas.records import TokenizedSample  # noqa: E402
from eyas.store import HiddenStateStore, StoreHeader  # noqa: E402
from eyas.train.data import SampleDataset  # noqa: E402
from eyas.train.loop import train  # noqa: E402

# name -> (draft shape, sample length T, samples per step B)
SHAPES = {
    "smollm2": (train_step.SMOLLM2, 1024, 16),      # 16,384 tokens a step, as issue 11's step figure
    "llama31_8b": (train_step.LLAMA31_8B, 2048, 1),  # 2,048 tokens a step, as BENCHMARKS.md's step table
    "tiny": (train_step.TINY, 96, 3),
}


def write_store(root: Path, cfg: Eagle3Config, T: int, n: int, seed: int = 0) -> list[TokenizedSample]:
    """A store of ``n`` random samples of T tokens (bf16 aux + last), and their tokenized records."""
    g = torch.Generator().manual_seed(seed)
    Ht = cfg.target_hidden_size
    header = StoreHeader(run_id="bench", target={"path": "random", "num_layers": 0, "hidden_size": Ht},
                         tokenizer={}, layer_ids=[1, 2, 3], layer_convention="output_of_layer",
                         last_hidden="post_norm", hidden_size=Ht, dtype="bfloat16", engine={"name": "bench"})
    store = HiddenStateStore.create_or_open(root, header)
    w = store.shard_writer()
    samples = []
    for i in range(n):
        ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
        aux = torch.randn(T, 3, Ht, generator=g).to(torch.bfloat16)
        last = torch.randn(T, Ht, generator=g).to(torch.bfloat16)
        w.add(f"s{i}", ids, aux, last)
        if w.buffered_bytes > 256 << 20:
            w.commit()
        samples.append(TokenizedSample(f"s{i}", ids.tolist(), [0] + [1] * (T - 1)))
    w.close()
    store.reload()
    return samples


def in_loop(cfg: Eagle3Config, T: int, B: int, device: torch.device, attention: str, store_dir: Path, warmup: int,
            iters: int, workers: int | None) -> dict:
    n_unique = max(4 * B, 8)
    steps = warmup + iters
    t0 = time.time()
    samples = write_store(store_dir / "store", cfg, T, n_unique)
    write_s = time.time() - t0
    model, data, _, _ = train_step.build(cfg, T, device, attention)
    head = data["head"]
    del data
    tc = TrainConfig(ttt_steps=7, epochs=steps * B / n_unique, lr=1e-4, batch_size=B, checkpoint_every=10 ** 6,
                     log_every=10 ** 6, tensorboard=False, attention=attention, device=str(device),
                     loader_workers=workers, max_length=T)
    out = store_dir / "run"
    t0 = time.time()
    res = train(model, SampleDataset(samples, T, HiddenStateStore.open(store_dir / "store")), head, tc, out, device,
                {}, log=lambda m: None)
    wall = time.time() - t0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["recent_tokens_per_s"] for r in rows[warmup:]]
    return {"in_loop_tokens_per_s": round(statistics.median(rates), 1), "steps": res.steps,
            "timed_steps": len(rates), "loop_wall_s": round(wall, 1), "store_write_s": round(write_s, 1),
            "peak_gb": rows[-1].get("gpu_max_memory_gb"), "final_loss": round(rows[-1]["loss"], 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["smollm2", "llama31_8b"], choices=list(SHAPES))
    ap.add_argument("--attention", default="flex")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--workers", type=int, default=None, help="train.loader_workers (default: the loop's own)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--store-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    shapes = ["tiny"] if args.tiny else args.shapes
    rows = []
    for name in shapes:
        shape, T, B = SHAPES[name]
        cfg = Eagle3Config(**shape)
        root = Path(tempfile.mkdtemp(prefix=f"eyas-loop-{name}-", dir=args.store_dir))
        compiled = device.type == "cuda"
        step = train_step.measure(cfg, T, 7, device, args.attention, compiled, args.warmup, args.iters, 2048,
                                  batch=B)
        loop = in_loop(cfg, T, B, device, args.attention, root, args.warmup, args.iters, args.workers)
        r = {"shape": name, "seq": T, "batch": B, "tokens_per_step": T * B, "attention": args.attention,
             "step_tokens_per_s": step["tokens_per_s"], "step_ms": step["step_ms"], "step_peak_gb": step.get("peak_gb"),
             **loop}
        r["ratio"] = round(r["in_loop_tokens_per_s"] / r["step_tokens_per_s"], 3)
        rows.append(r)
        print(json.dumps(r), flush=True)
        if args.out:
            args.out.write_text(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                                            "torch": torch.__version__, "rows": rows}, indent=1))
    print("\nshape        tokens/step  step tok/s  in-loop tok/s  ratio")
    for r in rows:
        print(f"{r['shape']:12} {r['tokens_per_step']:11} {r['step_tokens_per_s']:11.0f} "
              f"{r['in_loop_tokens_per_s']:14.0f} {r['ratio']:6.2f}")


if __name__ == "__main__":
    main()
