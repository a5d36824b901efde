"""extract: target hidden states (aux layers + post-norm last state) into the store, keyed by sample id.

Only samples of this run's tokenized dataset are captured: the store is addressed by their ids, so nothing else
(warm-up, health checks, another run's samples) can enter it. Each sample is validated before commit (row count
equals token count, width equals layers x H, dtype, finite) and shards are committed atomically; a re-run resumes
from the validated manifest and extracts only what is missing.
"""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from ..capture.transformers_backend import TransformersCapture, token_budget_batches
from ..families import STORE_CONVENTION, check_layer_ids, default_aux_layer_ids
from ..io import read_json, sha256_file
from ..store import HiddenStateStore, StoreHeader
from ..store.shards import DTYPES
from ..targets.load import load_target, materialize_target, read_target_config
from . import RunContext
from .tokenize import load_samples


def aux_layer_ids(ctx: RunContext) -> list[int]:
    """The configured aux layer ids, or the default ``[1, N//2-1, N-4]`` (``output_of_layer``)."""
    n = int(read_target_config(ctx.cfg.target)["num_hidden_layers"])
    ids = ctx.cfg.extract.layer_ids or default_aux_layer_ids(n)
    check_layer_ids(ids, n)
    return ids


def expected_header(ctx: RunContext) -> StoreHeader:
    """The header this run's store must have (run id, target, tokenizer, layers, dtype)."""
    import transformers

    tcfg = read_target_config(ctx.cfg.target)
    path = materialize_target(ctx.cfg.target)
    meta = read_json(ctx.stage_dir("tokenize") / "meta.json")
    return StoreHeader(
        run_id=ctx.run_id(),
        target={"path": str(path), "config_sha256": sha256_file(path / "config.json"),
                "num_layers": int(tcfg["num_hidden_layers"]), "hidden_size": int(tcfg["hidden_size"])},
        tokenizer=meta["tokenizer"],
        layer_ids=aux_layer_ids(ctx),
        layer_convention=STORE_CONVENTION,
        last_hidden="post_norm",
        hidden_size=int(tcfg["hidden_size"]),
        dtype=ctx.cfg.extract.dtype,
        engine={"name": "transformers", "version": transformers.__version__, "target_dtype": ctx.cfg.target.dtype},
    )


def store_path(ctx: RunContext):
    return ctx.stage_dir("extract") / "store"


def run(ctx: RunContext) -> dict:
    cfg = ctx.cfg.extract
    samples = load_samples(ctx)
    header = expected_header(ctx)
    store = HiddenStateStore.create_or_open(store_path(ctx), header)
    resumed = store.validate_for_resume()
    todo = [s for s in samples if s.id not in store]
    if len(store):
        ctx.log(f"[eyas] extract: resuming, {len(store)} samples already stored and validated "
                f"({resumed['orphans_removed']} orphan files removed)")
    if todo:
        target = load_target(ctx.cfg.target)
        capture = TransformersCapture(target.model, header.layer_ids)
        writer = store.shard_writer(rank=0)
        dt = DTYPES[cfg.dtype]
        t0, n_tokens = time.time(), 0
        bar = tqdm(total=sum(s.num_tokens for s in samples), initial=sum(s.num_tokens for s in samples) - sum(
            s.num_tokens for s in todo), desc="extract", unit="tok", unit_scale=True, dynamic_ncols=True)
        try:
            for batch_idx in token_budget_batches([s.num_tokens for s in todo], cfg.batch_tokens):
                batch = [todo[i] for i in batch_idx]
                T = max(s.num_tokens for s in batch)
                ids = torch.zeros(len(batch), T, dtype=torch.long)
                mask = torch.zeros(len(batch), T, dtype=torch.long)
                for r, s in enumerate(batch):
                    ids[r, : s.num_tokens] = torch.tensor(s.input_ids)
                    mask[r, : s.num_tokens] = 1
                aux, last = capture(ids.to(target.device), mask.to(target.device))
                for r, s in enumerate(batch):
                    n = s.num_tokens
                    writer.add(s.id, ids[r, :n], aux[r, :n].to(dt), last[r, :n].to(dt))
                    n_tokens += n
                if writer.buffered_bytes >= cfg.shard_bytes:
                    writer.commit()
                bar.update(sum(s.num_tokens for s in batch))
        finally:
            writer.close()  # commit whatever is complete, even on an interruption
            capture.close()
            bar.close()
        seconds = time.time() - t0
        ctx.log(f"[eyas] extract: {n_tokens} tokens in {seconds:.1f} s ({n_tokens / max(seconds, 1e-9):.0f} tokens/s)")
    missing = [s.id for s in samples if s.id not in store]
    if missing:
        raise RuntimeError(f"extract finished with {len(missing)} samples missing (first: {missing[0]})")
    total_tokens = sum(store.entry(s.id).tokens for s in samples)
    total_bytes = sum(r.bytes for r in store.manifest_records())
    return {"samples": len(samples), "tokens": total_tokens, "layer_ids": header.layer_ids,
            "layer_convention": header.layer_convention, "dtype": cfg.dtype, "store_bytes": total_bytes,
            "bytes_per_token": round(total_bytes / max(total_tokens, 1), 1)}
