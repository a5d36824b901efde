"""Hidden-state extraction throughput against a plain forward pass of the same model on the same batches.

For each target shape (random weights, built from a ``LlamaConfig``: no download), in one process:
1. the batch plan of the extract stage (:func:`token_budget_batches`, sequences sorted by length) over synthetic
   samples whose lengths follow a ShareGPT-like log-normal (median 600 tokens, cut to [32, max_len]);
2. ``plain``: the base model's forward pass over every batch (no hooks, nothing copied), synchronised at the end;
3. ``extract``: Eyas's whole extraction path over the same batches: hooks on the aux layers, packed exact
   slicing, bf16 (or fp8) cast on the GPU, asynchronous copy to pinned memory, the sample-id and token-id check,
   validation + checksums in a thread pool, shards written and fsynced by the background writer
   (:class:`~eyas.store.pipeline.BackgroundWriter`), timed until the last shard and manifest line are durable;
4. ``plain`` again (the two plain timings bound the noise); before all, one untimed plain pass over every batch
   shape and a short extraction warm up kernels, the pinned-memory cache and the thread pools.
``ratio = extract tokens/s / plain tokens/s`` (plain = mean of the two runs); ``bytes_per_token`` = store bytes
(shards, headers included) / tokens.

Imports only ``eyas.capture``, ``eyas.store`` and ``eyas.records`` (torch, transformers, safetensors, tqdm), so it
runs in an image without pydantic or typer.

    python bench/extract_throughput.py --models smollm2 llama31_8b --out results.json   # GPU
    python bench/extract_throughput.py --tiny --device cpu                               # seconds-long check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eyas.batching import token_budget_batches  # noqa: E402
from eyas.capture.transformers_backend import TransformersBackend  # noqa: E402
from eyas.records import TokenizedSample  # noqa: E402
from eyas.store import HiddenStateStore, StoreHeader  # noqa: E402
from eyas.store.pipeline import BackgroundWriter  # noqa: E402

# config.json shapes (HuggingFaceTB/SmolLM2-135M-Instruct; meta-llama/Llama-3.1-8B-Instruct), as the families table.
SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0,
                    max_position_embeddings=8192, tie_word_embeddings=True),
    "llama31_8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
                       max_position_embeddings=131072, tie_word_embeddings=False),
    "tiny": dict(hidden_size=40, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=10, vocab_size=99, max_position_embeddings=512),
}


def build_model(name: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The base model (decoder stack, no lm_head) of the named shape, random weights, on ``device``."""
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(**SHAPES[name], rms_norm_eps=1e-5)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaModel(cfg).to(dtype)
    return model.eval().requires_grad_(False)


def synthetic_samples(n_tokens: int, max_len: int, vocab: int, seed: int = 0) -> list[TokenizedSample]:
    """Samples with log-normal lengths (median 600, sigma 0.8, cut to [32, max_len]) until ``n_tokens``."""
    g = torch.Generator().manual_seed(seed)
    out, total = [], 0
    while total < n_tokens:
        n = int(min(max_len, max(32, 600 * float(torch.exp(0.8 * torch.randn((), generator=g))))))
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        out.append(TokenizedSample(f"s{len(out):07d}", ids, [1] * n))
        total += n
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def time_plain(model, batches, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    for batch in batches:
        B, T = len(batch), batch[0].num_tokens
        ids = torch.zeros(B, T, dtype=torch.long)
        mask = torch.zeros(B, T, dtype=torch.long)
        for r, s in enumerate(batch):
            ids[r, : s.num_tokens] = torch.tensor(s.input_ids)
            mask[r, : s.num_tokens] = 1
        model(input_ids=ids.to(device, non_blocking=True), attention_mask=mask.to(device, non_blocking=True),
              use_cache=False)
    _sync(device)
    return time.perf_counter() - t0


def _header(model, layer_ids, aux_format) -> StoreHeader:
    H = int(model.config.hidden_size)
    return StoreHeader(run_id="bench", target={"shape": "random"}, tokenizer={}, layer_ids=layer_ids,
                       layer_convention="output_of_layer", last_hidden="post_norm", hidden_size=H,
                       dtype="bfloat16", engine={"name": "transformers"}, aux_format=aux_format)


def time_extract(model, samples, layer_ids, batch_tokens, root: Path, aux_format: str, shard_bytes: int,
                 store_dtype: torch.dtype) -> tuple[float, int]:
    """Seconds for the whole extraction of ``samples`` into a new store under ``root``; store bytes."""
    shutil.rmtree(root, ignore_errors=True)
    store = HiddenStateStore.create_or_open(root, _header(model, layer_ids, aux_format))
    backend = TransformersBackend(model, layer_ids, batch_tokens=batch_tokens, store_dtype=store_dtype,
                                  aux_format=aux_format)
    asked = {s.id: s for s in samples}
    t0 = time.perf_counter()
    writer = BackgroundWriter(store.shard_writer(0), shard_bytes)
    try:
        for cs in backend.capture(samples):
            s = asked[cs.sample_id]  # the stage's checks: asked-for id, same token ids
            if cs.input_ids.shape[0] != s.num_tokens or cs.input_ids.tolist() != s.input_ids:
                raise RuntimeError(f"{s.id}: token ids differ")
            writer.put(cs)
    finally:
        writer.close()
        backend.close()
    seconds = time.perf_counter() - t0
    nbytes = sum(r.bytes for r in store.manifest_records())
    assert len(store) == len(samples)
    return seconds, nbytes


def bench_model(name, args, device, root: Path) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t_build = time.perf_counter()
    model = build_model(name, device, dtype)
    n = int(model.config.num_hidden_layers)
    layer_ids = [1, n // 2 - 1, n - 4]
    tokens = args.tokens.get(name, args.tokens["default"])
    samples = synthetic_samples(tokens, args.max_len, int(model.config.vocab_size))
    samples = [samples[i] for b in token_budget_batches([s.num_tokens for s in samples], args.batch_tokens)
               for i in b]  # the stage's batch plan order
    batches = [[samples[i] for i in b] for b in token_budget_batches([s.num_tokens for s in samples],
                                                                      args.batch_tokens)]
    n_tok = sum(s.num_tokens for s in samples)
    padded = sum(len(b) * b[0].num_tokens for b in batches)
    build_s = time.perf_counter() - t_build
    # warm-up: every batch shape once (cuBLAS heuristics, SDPA kernels), pinned-memory cache, thread pools
    time_plain(model, batches, device)
    time_extract(model, [s for b in batches[:2] for s in b], layer_ids, args.batch_tokens, root / "warm", "same",
                 args.shard_bytes, torch.bfloat16)
    plain1 = time_plain(model, batches, device)
    ext_s, bytes_bf16 = time_extract(model, samples, layer_ids, args.batch_tokens, root / "bf16", "same",
                                     args.shard_bytes, torch.bfloat16)
    shutil.rmtree(root / "bf16", ignore_errors=True)
    fp8_s, bytes_fp8 = time_extract(model, samples, layer_ids, args.batch_tokens, root / "fp8", "float8_e4m3fn",
                                    args.shard_bytes, torch.bfloat16)
    shutil.rmtree(root / "fp8", ignore_errors=True)
    plain2 = time_plain(model, batches, device)
    plain = (plain1 + plain2) / 2
    H = int(model.config.hidden_size)
    res = {
        "model": name, "hidden_size": H, "layers": n, "aux_layer_ids": layer_ids, "dtype": str(dtype),
        "samples": len(samples), "tokens": n_tok, "padded_tokens": padded, "batches": len(batches),
        "batch_tokens": args.batch_tokens, "build_s": round(build_s, 2),
        "plain_s": [round(plain1, 3), round(plain2, 3)], "plain_tokens_per_s": round(n_tok / plain),
        "extract_bf16_s": round(ext_s, 3), "extract_bf16_tokens_per_s": round(n_tok / ext_s),
        "ratio_bf16": round(plain / ext_s, 3),
        "extract_fp8_s": round(fp8_s, 3), "extract_fp8_tokens_per_s": round(n_tok / fp8_s),
        "ratio_fp8": round(plain / fp8_s, 3),
        "bytes_per_token_bf16": round(bytes_bf16 / n_tok, 1), "bytes_per_token_fp8": round(bytes_fp8 / n_tok, 1),
        "bytes_per_token_bf16_formula_8H_plus_4": 8 * H + 4, "store_write_GBps_bf16": round(bytes_bf16 / ext_s / 1e9, 2),
    }
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "llama31_8b"])
    ap.add_argument("--tokens", type=int, nargs="*", default=None, help="tokens per model (same order)")
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--shard-bytes", type=int, default=256 << 20)
    ap.add_argument("--store-dir", default=None, help="where the stores are written (default: /dev/shm or tmp)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a seconds-long check of the script on a tiny shape")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.tiny:
        args.models, args.batch_tokens, args.max_len, args.shard_bytes = ["tiny"], 1024, 256, 1 << 16
        args.tokens = {"default": 6000}
    else:
        defaults = {"smollm2": 800_000, "llama31_8b": 200_000}
        given = dict(zip(args.models, args.tokens)) if args.tokens else {}
        args.tokens = {"default": 200_000, **defaults, **given}
    device = torch.device(args.device)
    base = args.store_dir or ("/dev/shm" if Path("/dev/shm").is_dir() and device.type == "cuda" else None)
    root = Path(tempfile.mkdtemp(prefix="eyas-extract-bench-", dir=base))
    env = {"torch": torch.__version__, "python": platform.python_version(), "store_dir": str(root),
           "cpus": os.cpu_count(), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    import transformers

    env["transformers"] = transformers.__version__
    results = []
    try:
        for name in args.models:
            try:
                r = bench_model(name, args, device, root)
            except Exception as e:  # keep the other model's figures
                r = {"model": name, "error": f"{type(e).__name__}: {e}"}
            results.append(r)
            print(json.dumps(r), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"env": env, "results": results}, indent=2) + "\n")
    print(f"\n{env}")
    print(f"{'model':12s} {'tokens':>9s} {'plain tok/s':>12s} {'extract bf16':>13s} {'ratio':>6s} "
          f"{'extract fp8':>12s} {'ratio':>6s} {'B/tok bf16':>10s} {'B/tok fp8':>9s}")
    for r in results:
        if "error" in r:
            print(f"{r['model']:12s} ERROR {r['error']}")
            continue
        print(f"{r['model']:12s} {r['tokens']:9d} {r['plain_tokens_per_s']:12d} {r['extract_bf16_tokens_per_s']:13d} "
              f"{r['ratio_bf16']:6.3f} {r['extract_fp8_tokens_per_s']:12d} {r['ratio_fp8']:6.3f} "
              f"{r['bytes_per_token_bf16']:10.1f} {r['bytes_per_token_fp8']:9.1f}")


if __name__ == "__main__":
    main()
