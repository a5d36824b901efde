"""extract: target hidden states (aux layers + post-norm last state) into the store, keyed by sample id.

Only samples of this run's tokenized dataset are captured: the backend (``extract.backend``, :mod:`eyas.capture`)
is given those samples and whatever it yields is checked against them (id asked for, same token ids) before it
reaches the writer, so nothing else (warm-up, health checks, another run's samples) can enter the store. Each
sample is validated before commit (row count equals token count, width equals layers x H, dtype, finite) and
shards are committed atomically (:mod:`eyas.store.shards`).

Before anything is written, extract states the bytes it will write (the samples the store lacks, at the store's
bytes per token) and refuses to start when the disk holding the store has less free space
(``extract.ignore_disk_space: true`` overrides; :mod:`eyas.store.space`).

Batches are planned once from the whole dataset (:func:`plan_batches`); a re-run (after a crash, or
``eyas doctor --repair``) recomputes only the planned batches that hold a missing sample and stores only the missing
samples, so a resumed store is bit-identical to an uninterrupted one on the same machine.

Data parallel: ``torchrun --nproc-per-node G -m eyas.cli extract CONFIG`` runs one target replica per rank (GPU
``LOCAL_RANK``, or CPU with gloo); rank r takes planned batches r, r+G, ... of the work and writes its own shards
and ``manifest/rank-r.jsonl``. Rank 0 cleans the store before the others start, and ``done.json`` is written by
rank 0 only after a barrier that every rank reaches when its samples are committed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..capture import engine_info, make_backend
from ..errors import ConfigError, DataError, StoreError
from ..families import STORE_CONVENTION, check_run_servable, default_aux_layer_ids, text_config
from ..io import read_json, sha256_bytes, sha256_file
from ..records import TokenizedSample
from ..store import HiddenStateStore, StoreHeader
from ..store.pipeline import BackgroundWriter
from ..store.shards import read_safetensors_header
from ..store.space import check_disk_space, store_bytes_per_token
from ..targets.load import materialize_target, read_target_config, resolve_device
from . import RunContext
from .tokenize import load_samples


def aux_layer_ids(ctx: RunContext) -> list[int]:
    """The configured aux layer ids, or the default ``[1, N//2-1, N-4]`` (``output_of_layer``). Raises
    :class:`ConfigError` when the engines of ``export.formats`` could not serve a drafter on them."""
    tcfg = read_target_config(ctx.cfg.target)
    n = int(text_config(tcfg)["num_hidden_layers"])
    ids = ctx.cfg.extract.layer_ids or default_aux_layer_ids(n, tcfg)  # the family's engine default
    check_run_servable(ctx.cfg, tcfg)
    return ids


def weights_fingerprint(path: Path) -> str:
    """sha256 over each safetensors file's name, size and header (tensor names, dtypes, shapes, offsets).

    Cheap (a few KiB per file) and enough to tell checkpoints apart; a change of weight values that keeps every
    shape and file size is not seen (the target folder's ``config.json`` hash is recorded beside it).
    """
    parts = []
    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            raw, _ = read_safetensors_header(f)
        except ValueError as e:
            raise ConfigError(f"{f}: not a readable safetensors file ({e})") from None
        parts += [f.name.encode(), str(f.stat().st_size).encode(), raw]
    return sha256_bytes(*parts)


def expected_header(ctx: RunContext, engine: dict | None = None) -> StoreHeader:
    """The header this run's store must have (run id, target, tokenizer, layers, dtype, aux format)."""
    cfg = ctx.cfg.extract
    tcfg = text_config(read_target_config(ctx.cfg.target))
    path = materialize_target(ctx.cfg.target)
    meta = read_json(ctx.stage_dir("tokenize") / "meta.json")
    return StoreHeader(
        run_id=ctx.run_id(),
        target={"path": str(path), "config_sha256": sha256_file(path / "config.json"),
                "weights_sha256": weights_fingerprint(path),
                "num_layers": int(tcfg["num_hidden_layers"]), "hidden_size": int(tcfg["hidden_size"])},
        tokenizer=meta["tokenizer"],
        layer_ids=aux_layer_ids(ctx),
        layer_convention=STORE_CONVENTION,
        last_hidden="post_norm",
        hidden_size=int(tcfg["hidden_size"]),
        dtype=cfg.dtype,
        aux_format=cfg.aux_format,
        engine=engine or engine_info(cfg.backend, ctx.cfg.target, cfg),
    )


def store_path(ctx: RunContext) -> Path:
    """The run's hidden-state store folder, ``RUN/extract/store``."""
    return ctx.stage_dir("extract") / "store"


def plan_batches(samples: list[TokenizedSample], batch_tokens: int) -> list[list[TokenizedSample]]:
    """The run's batch plan: samples sorted by length (longest first, ties in dataset order), cut into batches of
    at most ``batch_tokens`` padded tokens (:func:`eyas.capture.transformers_backend.token_budget_batches`).
    Depends only on the dataset and the budget, so a resumed run recomputes exactly the same batches."""
    from ..capture.transformers_backend import token_budget_batches

    return [[samples[i] for i in b] for b in token_budget_batches([s.num_tokens for s in samples], batch_tokens)]


class _Dist:
    """Data-parallel context from torchrun's environment; a no-op on one process."""

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._owns_group = False
        if self.world > 1 and not torch.distributed.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            torch.distributed.init_process_group(backend=backend)
            self._owns_group = True

    def device(self, configured: str) -> str | None:
        """This rank's device: GPU ``LOCAL_RANK`` under torchrun on a GPU machine, else the configured one."""
        if self.world > 1 and resolve_device(configured).type == "cuda":
            torch.cuda.set_device(self.local_rank)
            return f"cuda:{self.local_rank}"
        return None

    def barrier(self) -> None:
        """Wait for every rank (no-op on one process)."""
        if self.world > 1:
            if torch.distributed.get_backend() == "nccl":
                torch.distributed.barrier(device_ids=[self.local_rank])
            else:
                torch.distributed.barrier()

    def close(self) -> None:
        """Destroy the process group if this context created it."""
        if self._owns_group:
            torch.distributed.destroy_process_group()


def run(ctx: RunContext) -> dict:
    """The extract stage: capture every tokenized sample the store lacks; returns the stage summary (samples,
    tokens, layer ids, store bytes, bytes per token, tokens/s). Raises :class:`StoreError` when samples are still
    missing at the end, or the store belongs to another run or configuration."""
    cfg = ctx.cfg.extract
    dist = _Dist()
    try:
        if dist.world > 1 and cfg.device_map:
            raise ConfigError("extract.device_map: spreading one target over all GPUs cannot be combined with "
                              "torchrun data parallelism; use one or the other")
        samples = load_samples(ctx)
        if not samples:
            raise DataError(f"extract: {ctx.stage_dir('tokenize') / 'samples.jsonl'} holds no sample; rerun "
                            f"tokenize with --force")
        header = expected_header(ctx)
        check_store_space(ctx, header, samples)   # every rank, before any writes: they all stop alike
        if dist.rank == 0:  # cleans orphans and temporaries: nobody else may be writing yet
            store = HiddenStateStore.create_or_open(store_path(ctx), header)
            resumed = store.validate_for_resume()
            if len(store):
                ctx.log(f"[eyas] extract: resuming, {len(store)} samples already stored and validated "
                        f"({resumed['orphans_removed']} orphan files removed)")
        dist.barrier()
        if dist.rank != 0:
            store = HiddenStateStore.create_or_open(store_path(ctx), header)
        stats = extract_missing(ctx, store, samples, dist)
        dist.barrier()  # every rank's samples are committed
        store.reload()
    finally:
        dist.close()
    ctx.extra["write_done"] = dist.rank == 0
    missing = [s.id for s in samples if s.id not in store]
    if missing:
        raise StoreError(f"extract finished with {len(missing)} samples missing (first: {missing[0]})")
    total_tokens = sum(store.entry(s.id).tokens for s in samples)
    total_bytes = sum(r.bytes for r in store.manifest_records())
    return {"samples": len(samples), "tokens": total_tokens, "layer_ids": header.layer_ids,
            "layer_convention": header.layer_convention, "dtype": cfg.dtype, "aux_format": cfg.aux_format,
            "store_bytes": total_bytes, "bytes_per_token": round(total_bytes / max(total_tokens, 1), 1),
            "tokens_per_s": stats.get("tokens_per_s"), "ranks": dist.world}


def check_store_space(ctx: RunContext, header: StoreHeader, samples: list[TokenizedSample]) -> int:
    """State the bytes extract will write (the samples the store lacks, at the store's bytes per token, plus one
    shard in flight per process) and refuse to start when the store's disk has less free space, unless
    ``extract.ignore_disk_space``. Returns the bytes it will write."""
    cfg = ctx.cfg.extract
    path = store_path(ctx)
    stored: set[str] = set()
    if (path / "store.json").exists():
        try:
            stored = set(HiddenStateStore.open(path).ids())
        except StoreError:
            stored = set()   # an unreadable or foreign store is refused by create_or_open, with its reason
    todo = [s for s in samples if s.id not in stored]
    tokens = sum(s.num_tokens for s in todo)
    per_token = store_bytes_per_token(header.hidden_size, len(header.layer_ids), header.dtype, header.aux_format)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    need = tokens * per_token + (cfg.shard_bytes * world if todo else 0)
    from ..plan import human_bytes

    ctx.log(f"[eyas] extract: will write {human_bytes(need)} ({len(todo)} samples, {tokens:,} tokens x {per_token:,} "
            f"bytes/token, plus one shard in flight per process) to {path}")
    check_disk_space(need, path, ignore=cfg.ignore_disk_space, what="extract", log=ctx.log)
    return need


def extract_missing(ctx: RunContext, store: HiddenStateStore, samples: list[TokenizedSample], dist=None) -> dict:
    """Capture and store every sample of ``samples`` that ``store`` lacks (this rank's share of the work).

    Recomputes each planned batch that holds a missing sample; only missing samples are written. Raises
    :class:`StoreError` when the backend yields a sample id it was not asked for, or other token ids.
    """
    cfg = ctx.cfg.extract
    rank, world = (dist.rank, dist.world) if dist else (0, 1)
    work = [b for b in plan_batches(samples, cfg.batch_tokens) if any(s.id not in store for s in b)]
    mine = work[rank::world]
    if not mine:
        return {"tokens": 0}
    asked = {s.id: s for b in mine for s in b}
    wanted = {sid for sid in asked if sid not in store}
    backend = make_backend(cfg.backend, ctx.cfg.target, cfg, store.header.layer_ids,
                           dist.device(ctx.cfg.target.device) if dist else None)
    writer = BackgroundWriter(store.shard_writer(rank=rank), cfg.shard_bytes)
    bar = tqdm(total=sum(asked[s].num_tokens for s in wanted), desc=f"extract[{rank}]", unit="tok",
               unit_scale=True, dynamic_ncols=True, disable=rank != 0)
    t0 = time.time()
    try:
        for cs in backend.capture([s for b in mine for s in b]):
            s = asked.get(cs.sample_id)
            if s is None:
                raise StoreError(f"capture backend {backend.engine.get('name')} returned sample "
                                 f"{cs.sample_id!r}, which was not asked for: refused (FIELD_NOTES rule 1)")
            if cs.input_ids.shape[0] != s.num_tokens or cs.input_ids.tolist() != s.input_ids:
                raise StoreError(f"sample {s.id}: the backend computed states for other token ids than the "
                                 f"tokenized dataset's")
            if s.id in wanted:
                wanted.discard(s.id)
                writer.put(cs)
                bar.update(s.num_tokens)
    finally:
        try:
            writer.close()  # commit whatever is complete, even on an interruption
        finally:
            backend.close()
            bar.close()
    seconds = time.time() - t0
    ctx.log(f"[eyas] extract[{rank}]: {writer.tokens} tokens in {seconds:.1f} s "
            f"({writer.tokens / max(seconds, 1e-9):.0f} tokens/s)")
    return {"tokens": writer.tokens, "tokens_per_s": round(writer.tokens / max(seconds, 1e-9), 1)}
