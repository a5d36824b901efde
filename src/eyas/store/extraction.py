"""Fill a run's store: target hidden states (aux layers + post-norm last state) of every tokenized sample, keyed by
sample id. The extract stage runs :func:`extract_store`; ``eyas doctor --repair`` runs it again for exactly the
samples a repair dropped.

Only samples of the run's tokenized dataset are captured: the backend (``extract.backend``, :mod:`eyas.capture`)
is given those samples and whatever it yields is checked against them (id asked for, same token ids) before it
reaches the writer, so nothing else (warm-up, health checks, another run's samples) can enter the store. Each
sample is validated before commit (row count equals token count, width equals layers x H, dtype, finite) and
shards are committed atomically (:mod:`eyas.store.shards`).

Batches are planned once from the whole dataset (:func:`plan_batches`); a re-run (after a crash, or
``eyas doctor --repair``) recomputes only the planned batches that hold a missing sample and stores only the missing
samples, so a resumed store is bit-identical to an uninterrupted one on the same machine.

Data parallel: ``torchrun --nproc-per-node G -m eyas.cli extract CONFIG`` runs one target replica per rank (GPU
``LOCAL_RANK``, or CPU with gloo); rank r takes planned batches r, r+G, ... of the work and writes its own shards
and ``manifest/rank-r.jsonl``. Rank 0 cleans the store before the others start; every rank has committed its
samples when :func:`extract_store` returns.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from ..batching import token_budget_batches
from ..capture import make_backend
from ..config import ExtractConfig, TargetConfig
from ..distributed import Dist
from ..dtypes import DTYPES
from ..errors import ConfigError, DataError, DiskFullError, StoreError, is_disk_full
from ..records import TokenizedSample, read_tokenized
from ..run_folder import RunFolder
from ..summaries import ExtractSummary
from ..targets.load import resolve_device
from .header import expected_header
from .labels import LabelMaker, smallest_k
from .pipeline import BackgroundWriter
from .shards import HiddenStateStore, StoreHeader
from .space import SAMPLE_OVERHEAD_BYTES, check_disk_space, disk_free, header_bytes_per_token


def plan_batches(samples: list[TokenizedSample], batch_tokens: int) -> list[list[TokenizedSample]]:
    """The run's batch plan: samples sorted by length (longest first, ties in dataset order), cut into batches of
    at most ``batch_tokens`` padded tokens (:func:`eyas.batching.token_budget_batches`).
    Depends only on the dataset and the budget, so a resumed run recomputes exactly the same batches."""
    return [[samples[i] for i in b] for b in token_budget_batches([s.num_tokens for s in samples], batch_tokens)]


def extract_store(target: TargetConfig, extract: ExtractConfig, run: RunFolder,
                  log: Callable[[str], None] = print) -> ExtractSummary:
    """Capture every tokenized sample of ``run`` that its store lacks; returns the summary (samples, tokens, layer
    ids, store bytes, bytes per token, tokens/s). Under torchrun every process calls this, each with its share.

    Raises :class:`StoreError` when samples are still missing at the end, or the store belongs to another run or
    configuration; :class:`ConfigError` for ``extract.device_map`` under torchrun.
    """
    dist = Dist.from_env(resolve_device(target.device))
    try:
        if dist.world > 1 and extract.device_map:
            raise ConfigError("extract.device_map: spreading one target over all GPUs cannot be combined with "
                              "torchrun data parallelism; use one or the other")
        samples = read_tokenized(run.tokenized)
        if not samples:
            raise DataError(f"extract: {run.tokenized} holds no sample; rerun tokenize with --force")
        header = expected_header(target, extract, run)
        check_store_space(extract, run, header, samples, log)   # every rank, before any writes: all stop alike
        if dist.rank == 0:  # cleans orphans and temporaries: nobody else may be writing yet
            store = HiddenStateStore.create_or_open(run.store, header)
            resumed = store.validate_for_resume()
            if len(store):
                log(f"[eyas] extract: resuming, {len(store)} samples already stored and validated "
                    f"({resumed['orphans_removed']} orphan files removed)")
        dist.barrier()
        if dist.rank != 0:
            store = HiddenStateStore.create_or_open(run.store, header)
        try:
            stats = extract_missing(target, extract, store, samples, dist, log, vocab=run.vocab)
        except Exception as e:
            if is_disk_full(e):
                raise disk_full_error(e, store, samples) from None
            raise
        dist.barrier()  # every rank's samples are committed
        store.reload()
    finally:
        dist.close()
    missing = [s.id for s in samples if s.id not in store]
    if missing:
        raise StoreError(f"extract finished with {len(missing)} samples missing (first: {missing[0]})")
    total_tokens = sum(store.entry(s.id).tokens for s in samples)
    total_bytes = sum(r.bytes for r in store.manifest_records())
    return ExtractSummary(samples=len(samples), tokens=total_tokens, layer_ids=header.layer_ids,
                          layer_convention=header.layer_convention, dtype=extract.dtype, aux_format=extract.aux_format,
                          store_bytes=total_bytes, bytes_per_token=round(total_bytes / max(total_tokens, 1), 1),
                          tokens_per_s=stats.get("tokens_per_s"), ranks=dist.world, labels=header.label_format,
                          label_topk=header.label_topk if header.topk else None,
                          label_mass_by_k=stats.get("label_mass_by_k"))


def check_store_space(extract: ExtractConfig, run: RunFolder, header: StoreHeader, samples: list[TokenizedSample],
                      log: Callable[[str], None] = print) -> int:
    """State the bytes extraction will write (the samples the store lacks: :func:`bytes_to_store`) and refuse to
    start when the store's disk has less free space, unless ``extract.ignore_disk_space``. Returns the bytes it will
    write. Raises :class:`StoreError` (names both sizes)."""
    from ..plan import human_bytes

    stored: set[str] = set()
    if (run.store / "store.json").exists():
        try:
            stored = set(HiddenStateStore.open(run.store).ids())
        except StoreError:
            stored = set()   # an unreadable or foreign store is refused by create_or_open, with its reason
    todo = [s for s in samples if s.id not in stored]
    tokens = sum(s.num_tokens for s in todo)
    per_token = header_bytes_per_token(header)
    need = bytes_to_store(header, todo)
    log(f"[eyas] extract: will write {human_bytes(need)} ({len(todo)} samples, {tokens:,} tokens x {per_token:,} "
        f"bytes/token, plus {SAMPLE_OVERHEAD_BYTES} bytes per sample of shard headers and manifest lines) to "
        f"{run.store}")
    check_disk_space(need, run.store, ignore=extract.ignore_disk_space, what="extract", log=log)
    return need


def bytes_to_store(header: StoreHeader, samples: list[TokenizedSample]) -> int:
    """The bytes storing ``samples`` adds to a store with ``header``: their tokens at the store's bytes per token,
    plus :data:`~eyas.store.space.SAMPLE_OVERHEAD_BYTES` per sample. A shard being written is the shard it will
    be (written under a temporary name and renamed, never copied), and the in-memory buffers that fill shards are
    not on disk, so nothing more is in flight."""
    per_token = header_bytes_per_token(header)
    return sum(s.num_tokens for s in samples) * per_token + len(samples) * SAMPLE_OVERHEAD_BYTES


def disk_full_error(e: BaseException, store: HiddenStateStore, samples: list[TokenizedSample]) -> DiskFullError:
    """The one error a user sees when the disk fills while ``store`` is written: the store, the samples committed
    (kept: every committed shard is whole and listed), the bytes still needed, and that the same command resumes."""
    from ..plan import human_bytes

    try:
        store.reload()   # what every rank has committed so far
    except StoreError:
        pass
    missing = [s for s in samples if s.id not in store]
    need = bytes_to_store(store.header, missing)
    where, free = disk_free(store.root)
    cause = getattr(e, "strerror", None) or str(e)
    return DiskFullError(
        f"extract: the disk is full ({cause}) while writing the hidden-state store {store.root}: "
        f"{len(samples) - len(missing)} of {len(samples)} samples are committed and kept; the other {len(missing)} "
        f"need about {human_bytes(need)} ({need:,} bytes) more, and the disk holding {where} has {human_bytes(free)} "
        f"free. Free space (or move run_dir) and run the same command again: it resumes from the committed samples.")


def extract_missing(target: TargetConfig, extract: ExtractConfig, store: HiddenStateStore,
                    samples: list[TokenizedSample], dist: Dist | None = None,
                    log: Callable[[str], None] = print, vocab: Path | None = None) -> dict:
    """Capture and store every sample of ``samples`` that ``store`` lacks (this rank's share of the work).
    ``vocab``: the run's ``vocab.safetensors``, which a top-k store's labels are made over (needed for one).

    Recomputes each planned batch that holds a missing sample; only missing samples are written. Raises
    :class:`StoreError` when the backend yields a sample id it was not asked for, or other token ids.
    """
    dist = dist or Dist()
    work = [b for b in plan_batches(samples, extract.batch_tokens) if any(s.id not in store for s in b)]
    mine = work[dist.rank::dist.world]
    if not mine:
        return {"tokens": 0}
    asked = {s.id: s for b in mine for s in b}
    wanted = {sid for sid in asked if sid not in store}
    # under torchrun on GPUs each rank's replica goes to its own GPU; else the configured device
    device = str(dist.device) if dist.world > 1 and dist.device.type == "cuda" else None
    backend = make_backend(extract.backend, target, extract, store.header.layer_ids, device)
    labeler = None
    if store.header.topk:
        # made where the states are when the backend can (only 4k + 1 bytes a token leave the device); else here
        on_backend = hasattr(backend, "labeler")
        labeler = make_labeler(target, store, vocab, backend.input_device if on_backend else device)
        if on_backend:
            backend.labeler = labeler
    writer = BackgroundWriter(store.shard_writer(rank=dist.rank), extract.shard_bytes)
    bar = tqdm(total=sum(asked[s].num_tokens for s in wanted), desc=f"extract[{dist.rank}]", unit="tok",
               unit_scale=True, dynamic_ncols=True, disable=dist.rank != 0)
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
                if labeler is not None and cs.labels is None:
                    cs = dataclasses.replace(cs, last=None, labels=labeler(cs.last))
                writer.put(cs)
                bar.update(s.num_tokens)
    finally:
        try:
            writer.close()  # commit whatever is complete, even on an interruption
        finally:
            backend.close()
            bar.close()
    seconds = time.time() - t0
    log(f"[eyas] extract[{dist.rank}]: {writer.tokens} tokens in {seconds:.1f} s "
        f"({writer.tokens / max(seconds, 1e-9):.0f} tokens/s)")
    out = {"tokens": writer.tokens, "tokens_per_s": round(writer.tokens / max(seconds, 1e-9), 1)}
    if labeler is not None and labeler.rows:
        out["label_mass_by_k"] = curve = labeler.curve()
        k, want = store.header.label_topk, extract.label_mass
        held = _mass_at(curve, k)
        enough = smallest_k(curve, want)
        log(f"[eyas] extract[{dist.rank}]: the top {k} draft ids hold {held:.4f} of the target's draft-vocabulary "
            f"mass on average over {labeler.rows:,} tokens (extract.label_mass asks {want}; the smallest k that "
            f"holds it: {enough or f'more than {max(curve)}'})")
        if held < want:
            log(f"[eyas] warning: extract.label_topk {k} holds less than extract.label_mass {want} "
                f"({held:.4f}); the rest is spread evenly over the other draft ids when training reads the labels. "
                f"Set extract.label_topk: {enough or max(curve)} and rebuild the store (`eyas extract CONFIG "
                f"--force`) to keep more")
    return out


def _mass_at(curve: dict[int, float], k: int) -> float:
    """The mean mass at ``k`` from a measured curve (linear between measured ks; the last one beyond them)."""
    ks = sorted(curve)
    if k in curve:
        return curve[k]
    lo = max([x for x in ks if x < k], default=ks[0])
    hi = min([x for x in ks if x > k], default=ks[-1])
    if hi == lo:
        return curve[lo]
    return curve[lo] + (curve[hi] - curve[lo]) * (k - lo) / (hi - lo)


def make_labeler(target: TargetConfig, store: HiddenStateStore, vocab: Path | None, device) -> LabelMaker:
    """The top-k label maker of a top-k store: the target's lm_head (from its safetensors files) and the run's
    draft vocabulary ``vocab`` (its ``vocab.safetensors``), checked against the store header's (its sha256). Raises
    :class:`StoreError` when ``vocab`` is missing or not the one the store's labels are made over."""
    from ..data.vocab import load_vocab
    from ..io import sha256_file
    from ..targets.load import load_target_head

    h = store.header
    if vocab is None or not vocab.exists() or sha256_file(vocab) != h.draft_vocab_sha256:
        raise StoreError(f"{store.root}: its top-{h.label_topk} labels are made over another draft vocabulary than "
                         f"{vocab}; rebuild the store with `eyas extract CONFIG --force`")
    d2t, t2d = load_vocab(vocab)
    _embed, lm_head = load_target_head(target)
    dev = resolve_device(target.device) if device is None else device
    return LabelMaker(lm_head, d2t, t2d, h.label_topk, device=dev, dtype=DTYPES[h.dtype])
