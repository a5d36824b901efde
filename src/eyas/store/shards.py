"""Hidden-state store: safetensors shards keyed by sample id, plus a manifest that is the only source of truth.

Layout of a store folder (one per run: ``RUN/extract/store``; its header names the run, so another run's files are
recognised wherever they are copied)::

    store.json                       StoreHeader: run id, target/tokenizer identity, layer ids + convention, dtype...
    shards/shard-R{rank:03d}-{n:06d}.safetensors
    manifest/rank-{rank:03d}.jsonl   one line per committed shard (one file per data-parallel rank)

Tensors of sample ``sid`` inside a shard (T tokens, H target hidden size, L aux layers, usually 3):
- ``{sid}.input_ids`` int32 [T]        token ids the states were computed from;
- ``{sid}.aux``       [T, L, H]        aux hidden states (outputs of the aux layers, ``output_of_layer`` ids), in
  the store dtype, or float8_e4m3fn when ``aux_format`` is ``float8_e4m3fn``;
- ``{sid}.aux_scale`` float32 [T, L]   fp8 only: one scale per token and layer (:mod:`eyas.store.fp8`);
- ``{sid}.last``      [T, H]           last hidden state, after the final norm (as SGLang / HF / SpecForge);
  or, with ``label_format`` ``topk`` (``extract.labels: topk``), in its place the target's distribution over the
  draft vocabulary as its top k (:mod:`eyas.store.labels`): ``{sid}.label_ids`` int16/int32 [T, k],
  ``{sid}.label_probs`` float16 [T, k], ``{sid}.label_flags`` uint8 [T].
Readers get ``aux`` back in the store dtype (fp8 de-quantised).

A manifest line is ``{"run_id", "shard", "bytes", "header_sha256", "samples": [ManifestEntry...]}``. A sample's
``checksum`` is sha256 over its stored tensors' raw bytes (input_ids, aux, [aux_scale,] last or the three label
tensors, in that order). The
file size, the sha256 of the safetensors header (tensor names, dtypes, shapes, offsets, run id) and the per-sample
checksums together pin every byte of a shard, so no whole-file hash is computed at write time.

Commit protocol (FIELD_NOTES, extraction rule 2): a shard is written under a temporary name, fsynced and renamed;
only then is its manifest line appended and fsynced. A shard without a manifest line (crash between the two) is an
orphan: resume deletes it and its samples are extracted again. Resume trusts a listed shard only after a cheap but
complete structural check (size, header hash, run id: a few KiB read per shard); ``eyas doctor`` re-hashes every
sample (:mod:`eyas.store.doctor`).
"""

from __future__ import annotations

import json
import struct
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ..dtypes import DTYPES, SAFETENSORS_CODES
from ..errors import StoreError
from ..io import JsonlAppender, atomic_path, read_json, repair_jsonl_tail, sha256_bytes, split_jsonl, write_json_atomic
from .fp8 import FP8, dequantize_fp8, fp8_has_nan, quantize_fp8
from .labels import PROB_DTYPE, CompactLabels, check_labels, label_id_dtype

FORMAT_VERSION = 2


@dataclass
class StoreHeader:
    """What a store was made from. Two stores (or a store and a run) match only when every identity field matches.

    ``target``: ``{"path", "config_sha256", "weights_sha256", "num_layers", "hidden_size"}``;
    ``tokenizer``: ``{"name_or_path", "vocab_size", "chat_template_sha256"}``;
    ``layer_ids`` in ``layer_convention`` (always ``output_of_layer`` in an Eyas store, FIELD_NOTES);
    ``last_hidden``: ``post_norm``; ``dtype``: storage dtype of ``last`` (and of ``aux`` unless ``aux_format`` is
    ``float8_e4m3fn``); ``engine``: ``{"name", "version", ...}`` of the capture backend. ``label_format``:
    ``hidden`` (``last`` stored) or ``topk`` (``label_topk`` draft ids and probabilities a token instead, made over
    the draft vocabulary whose ``vocab.safetensors`` hashes to ``draft_vocab_sha256``, of ``draft_vocab_size``
    ids; only offline training over that vocabulary can use them).
    """

    run_id: str
    target: dict
    tokenizer: dict
    layer_ids: list[int]
    layer_convention: str
    last_hidden: str
    hidden_size: int
    dtype: str
    engine: dict
    aux_format: str = "same"
    format_version: int = FORMAT_VERSION
    label_format: str = "hidden"
    label_topk: int = 0
    draft_vocab_size: int = 0
    draft_vocab_sha256: str = ""

    # Fields that may differ between runs that extract the same content (where it ran, with which engine).
    _IDENTITY_EXEMPT = ("engine",)

    def identity(self) -> dict:
        """Every field except those in ``_IDENTITY_EXEMPT``: what must match for samples to be mixed."""
        d = asdict(self)
        for k in self._IDENTITY_EXEMPT:
            d.pop(k)
        return d

    @property
    def fp8(self) -> bool:
        """True when aux states are stored as float8_e4m3fn with per-(token, layer) scales."""
        return self.aux_format == "float8_e4m3fn"

    @property
    def topk(self) -> bool:
        """True when the store holds top-k labels (:mod:`eyas.store.labels`) instead of the last hidden state."""
        return self.label_format == "topk"

    @property
    def aux_dtype(self) -> torch.dtype:
        """dtype of the stored ``aux`` tensor (float8_e4m3fn for fp8 stores)."""
        return FP8 if self.fp8 else DTYPES[self.dtype]


@dataclass
class SampleStates:
    """One sample read back: ``input_ids`` int32 [T], ``aux`` [T, L, H] and ``last`` [T, H] in the store dtype; in
    a top-k store ``last`` is None and ``labels`` holds the sample's :class:`~eyas.store.labels.CompactLabels`."""

    id: str
    input_ids: torch.Tensor
    aux: torch.Tensor
    last: torch.Tensor | None
    labels: CompactLabels | None = None


@dataclass
class ManifestEntry:
    """One sample in a manifest line: id, token count T, sha256 ``checksum`` of its stored tensors, ``aux_shape``
    [T, L, H], ``last_shape`` [T, H] (in a top-k store: [T, k], the label tensors') and the store dtype."""

    id: str
    tokens: int
    checksum: str
    aux_shape: list[int]
    last_shape: list[int]
    dtype: str


@dataclass
class ShardRecord:
    """One manifest line: a committed shard's file name, size in bytes, sha256 of its safetensors header, the run
    id that wrote it, and its samples."""

    shard: str
    bytes: int
    header_sha256: str
    run_id: str
    samples: list[ManifestEntry] = field(default_factory=list)
    manifest: str = ""   # "rank-000.jsonl:3": where the record was read (for messages)

    def to_json(self) -> dict:
        """The manifest line (without ``manifest``, which says where it was read)."""
        return {"run_id": self.run_id, "shard": self.shard, "bytes": self.bytes, "header_sha256": self.header_sha256,
                "samples": [asdict(e) for e in self.samples]}


@dataclass
class PreparedSample:
    """A validated sample in storage form, ready for :meth:`ShardWriter.append`."""

    entry: ManifestEntry
    tensors: dict[str, torch.Tensor]
    nbytes: int


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a CPU tensor in its own dtype (bf16 and fp8 included), C order, without a copy when contiguous."""
    return memoryview(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())


def sample_checksum(*tensors: torch.Tensor) -> str:
    """sha256 over the raw bytes of ``tensors`` in order (input_ids, aux, [aux_scale,] last)."""
    return sha256_bytes(*(tensor_bytes(t) for t in tensors))


def read_safetensors_header(path: Path) -> tuple[bytes, dict]:
    """The raw header bytes (8-byte length + JSON) of a safetensors file and the parsed JSON.

    Raises ``ValueError`` when the file is too short or the header is not valid JSON, and when the tensors' data
    offsets do not end exactly at the end of the file (truncated or extended). Format: safetensors README.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 << 20):
            raise ValueError(f"header length {n} exceeds the file")
        raw = f.read(n)
    try:
        meta = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"header is not valid JSON ({e})") from None
    end = max((v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise ValueError(f"file is {size} bytes, its header describes {8 + n + end}")
    return head + raw, meta


def safetensors_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding ``tensors`` back to back, in dict order.

    Format (safetensors README): little-endian u64 header length, a JSON object ``{name: {"dtype", "shape",
    "data_offsets": [begin, end]}, "__metadata__": {...}}`` padded with spaces to a multiple of 8 bytes, then the
    tensors' bytes. Writing the header ourselves lets :meth:`ShardWriter.write` stream each tensor's memory to the
    file, where ``safetensors.torch.save`` would first build the whole shard in memory three times over (measured
    on the H200 host: the store could not take more than about 0.5 GB/s that way, BENCHMARKS.md). Shards are read
    back with the safetensors library itself.
    """
    meta: dict = {"__metadata__": metadata}
    offset = 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        meta[k] = {"dtype": SAFETENSORS_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    js = json.dumps(meta, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    return struct.pack("<Q", len(js)) + js


LABEL_TENSORS = ("label_ids", "label_probs", "label_flags")


def stored_tensor_names(header: StoreHeader) -> list[str]:
    """The tensors of one sample in a store with ``header``, in checksum order."""
    return (["input_ids", "aux"] + (["aux_scale"] if header.fp8 else [])
            + (list(LABEL_TENSORS) if header.topk else ["last"]))


def _stored_names(sid: str, header: StoreHeader) -> list[str]:
    return [f"{sid}.{n}" for n in stored_tensor_names(header)]


class HiddenStateStore:
    """Writer and random-access reader of one store folder.

    Open with :meth:`create_or_open` (writer side: checks the header against the expected one) or :meth:`open`
    (reader). Reads are memory-mapped per tensor (``safe_open``): reading one sample never loads a whole shard.
    """

    def __init__(self, root: Path, header: StoreHeader):
        self.root = Path(root)
        self.header = header
        self._index: dict[str, tuple[str, ManifestEntry]] = {}
        self._handles: dict[str, object] = {}

    def __getstate__(self) -> dict:
        """Picklable without its open file handles (a DataLoader worker opens its own)."""
        return {**self.__dict__, "_handles": {}}

    # ---------------------------------------------------------------- opening
    @classmethod
    def create_or_open(cls, root: Path, header: StoreHeader) -> "HiddenStateStore":
        """Open ``root`` for writing; create it with ``header`` when new.

        Raises :class:`StoreError` when the folder holds a store of another run or configuration, naming the
        fields that differ.
        """
        root = Path(root)
        hpath = root / "store.json"
        if hpath.exists():
            old = read_header(hpath)
            if old.identity() != header.identity():
                diff = [k for k, v in header.identity().items() if old.identity().get(k) != v]
                raise StoreError(
                    f"{root} holds hidden states of another run or configuration (differs in: {', '.join(diff)}). "
                    f"Refusing to mix them: use a new run directory, or delete {root} to re-extract."
                )
        else:
            (root / "shards").mkdir(parents=True, exist_ok=True)
            (root / "manifest").mkdir(parents=True, exist_ok=True)
            write_json_atomic(hpath, asdict(header))
        store = cls(root, header)
        store._load_manifest()
        return store

    @classmethod
    def open(cls, root: Path) -> "HiddenStateStore":
        """Open an existing store for reading. Raises :class:`StoreError` when it is not one."""
        root = Path(root)
        hpath = root / "store.json"
        if not hpath.exists():
            raise StoreError(f"{root}: not a hidden-state store (no store.json)")
        store = cls(root, read_header(hpath))
        store._load_manifest()
        return store

    def manifest_files(self) -> list[Path]:
        """``manifest/rank-*.jsonl``, sorted."""
        mdir = self.root / "manifest"
        return sorted(mdir.glob("rank-*.jsonl")) if mdir.exists() else []

    def manifest_records(self) -> list[ShardRecord]:
        """Every committed shard record, all ranks, in file order. A torn last line (a crash while it was being
        appended, so its shard is an orphan) is ignored. Raises :class:`StoreError` on any other bad line."""
        recs = []
        for mf in self.manifest_files():
            lines, _torn = split_jsonl(mf.read_bytes())
            for lineno, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                    recs.append(ShardRecord(d["shard"], int(d["bytes"]), d["header_sha256"], d["run_id"],
                                            [ManifestEntry(**e) for e in d["samples"]], f"{mf.name}:{lineno}"))
                except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
                    raise StoreError(f"{mf}:{lineno}: not a manifest record ({type(e).__name__}: {e}); "
                                     f"run `eyas doctor RUN --repair`") from None
        return recs

    def _load_manifest(self) -> None:
        self._index.clear()
        for rec in self.manifest_records():
            for e in rec.samples:
                if e.id in self._index:
                    raise StoreError(f"{self.root}: sample {e.id} is listed twice in the manifest "
                                     f"({self._index[e.id][0]} and {rec.shard}); run `eyas doctor RUN --repair`")
                self._index[e.id] = (rec.shard, e)

    def reload(self) -> None:
        """Re-read the manifest (after other ranks or a repair changed it)."""
        self._handles.clear()
        self._load_manifest()

    # ---------------------------------------------------------------- resume
    def validate_for_resume(self) -> dict:
        """Check every listed shard cheaply but completely; cut torn manifest tails; delete orphans and temporaries.

        Per listed shard: it exists, its size and the sha256 of its safetensors header equal the manifest's, and
        the run id in the manifest line and in the shard's metadata is this store's. Only the header (a few KiB)
        is read; the tensor bytes are covered by per-sample checksums, re-hashed by ``eyas doctor``.

        Returns counts. Raises :class:`StoreError` naming the shard for the first failure (missing, truncated,
        replaced, foreign): run ``eyas doctor RUN --repair`` for those.
        """
        for mf in self.manifest_files():
            repair_jsonl_tail(mf)
        records = self.manifest_records()
        listed = {rec.shard: rec for rec in records}
        sdir = self.root / "shards"
        removed = 0
        for p in sorted(sdir.iterdir()) if sdir.exists() else []:
            if p.name not in listed:  # orphan (crash before the manifest line) or a temporary file
                p.unlink()
                removed += 1
        for rec in records:
            problem = self.check_shard_structure(rec)
            if problem:
                raise StoreError(f"{sdir / rec.shard} (manifest/{rec.manifest}): {problem}. "
                                 f"Run `eyas doctor RUN --repair` to re-extract its samples.")
        self.reload()
        return {"shards": len(listed), "samples": len(self._index), "orphans_removed": removed}

    def check_structure(self) -> None:
        """Every committed shard passes :meth:`check_shard_structure` (read-only: nothing is deleted or repaired).
        Raises :class:`StoreError` naming the first bad shard and the repair command."""
        for rec in self.manifest_records():
            problem = self.check_shard_structure(rec)
            if problem:
                raise StoreError(f"{self.root / 'shards' / rec.shard} (manifest/{rec.manifest}): {problem}. Run "
                                 f"`eyas doctor RUN --repair` to re-extract its samples.")

    def check_shard_structure(self, rec: ShardRecord) -> str | None:
        """A cheap, complete check of one shard's structure against its manifest record; ``None`` when it passes.

        Size, header hash (tensor names, dtypes, shapes, offsets), the run ids; reads only the header.
        """
        if rec.run_id != self.header.run_id:
            return f"manifest line belongs to run {rec.run_id}, this store is run {self.header.run_id} (foreign)"
        path = self.root / "shards" / rec.shard
        if not path.exists():
            return "listed in the manifest but missing"
        size = path.stat().st_size
        if size != rec.bytes:
            return f"size {size} differs from the manifest's {rec.bytes} (truncated or replaced)"
        try:
            raw, meta = read_safetensors_header(path)
        except ValueError as e:
            return f"unreadable safetensors header ({e})"
        if sha256_bytes(raw) != rec.header_sha256:
            return "safetensors header differs from the one committed (tensor names, shapes or offsets changed)"
        run = meta.get("__metadata__", {}).get("eyas_run_id")
        if run != self.header.run_id:
            return f"shard was written by run {run}, this store is run {self.header.run_id} (foreign)"
        return None

    # ---------------------------------------------------------------- writing
    def shard_writer(self, rank: int = 0) -> "ShardWriter":
        """A writer of this rank's shards and ``manifest/rank-{rank:03d}.jsonl``."""
        return ShardWriter(self, rank)

    # ---------------------------------------------------------------- reading
    def __contains__(self, sid: str) -> bool:
        return sid in self._index

    def __len__(self) -> int:
        return len(self._index)

    def ids(self) -> list[str]:
        """Sample ids in the manifest, in manifest order."""
        return list(self._index)

    def entry(self, sid: str) -> ManifestEntry:
        """The manifest entry of ``sid``; KeyError for an unknown id."""
        return self._index[sid][1]

    def _handle(self, shard: str):
        f = self._handles.get(shard)
        if f is None:
            f = safe_open(str(self.root / "shards" / shard), framework="pt")
            self._handles[shard] = f
        return f

    def read_stored(self, sid: str, verify: bool = False) -> dict[str, torch.Tensor]:
        """The sample's tensors exactly as stored (fp8 aux not de-quantised), keyed ``input_ids``, ``aux``,
        [``aux_scale``,] ``last`` (or ``label_ids``, ``label_probs``, ``label_flags``). ``verify``: re-hash them
        against the manifest's checksum (a flipped byte, a shard overwritten after commit). Raises KeyError for an
        unknown id; :class:`StoreError` naming the sample and its shard when the bytes cannot be read or
        (``verify``) differ from what was committed."""
        shard, entry = self._index[sid]
        try:
            f = self._handle(shard)
            t = {n.split(".")[-1]: f.get_tensor(n) for n in _stored_names(sid, self.header)}
        except Exception as e:  # truncated or damaged shard: safetensors' own errors, named here
            raise StoreError(f"sample {sid}: unreadable in {self.root / 'shards' / shard} ({type(e).__name__}: "
                             f"{e}); run `eyas doctor RUN --repair`") from None
        if verify and sample_checksum(*t.values()) != entry.checksum:
            raise StoreError(f"sample {sid}: its stored bytes in {self.root / 'shards' / shard} differ from the "
                             f"checksum committed with them (changed after extraction); run `eyas doctor RUN "
                             f"--repair` to re-extract it")
        return t

    def read(self, sid: str, verify: bool = False) -> SampleStates:
        """Random access to one sample (memory-mapped); ``aux`` in the store dtype. ``verify``: see
        :meth:`read_stored`. Raises KeyError for an unknown id, :class:`StoreError` for damaged bytes."""
        t = self.read_stored(sid, verify)
        aux = dequantize_fp8(t["aux"], t["aux_scale"], DTYPES[self.header.dtype]) if self.header.fp8 else t["aux"]
        if self.header.topk:
            return SampleStates(sid, t["input_ids"], aux, None,
                                CompactLabels(t["label_ids"], t["label_probs"], t["label_flags"]))
        return SampleStates(sid, t["input_ids"], aux, t["last"])


def read_header(path: Path) -> StoreHeader:
    """Parse ``store.json``; raises :class:`StoreError` naming the file when it is not a store header."""
    d = read_json(path)
    try:
        return StoreHeader(**d)
    except TypeError as e:
        raise StoreError(f"{path}: not an Eyas store header ({e})") from None


class ShardWriter:
    """Validates samples and commits them as shards (atomic rename, then manifest line).

    :meth:`prepare` (validate, quantise, checksum) and :meth:`write` are thread-safe and may run in pools;
    :meth:`append`, :meth:`take` and :meth:`commit` must be called from one thread. :meth:`add` does
    prepare + append.
    """

    def __init__(self, store: HiddenStateStore, rank: int):
        self.store = store
        self.rank = rank
        self.buffer: dict[str, torch.Tensor] = {}
        self.entries: list[ManifestEntry] = []
        self.buffered_bytes = 0
        prefix = f"shard-R{rank:03d}-"
        names = [p.name for p in (store.root / "shards").glob(prefix + "*.safetensors")]
        names += [r.shard for r in store.manifest_records() if r.shard.startswith(prefix)]
        used = [int(n[len(prefix):].split(".")[0]) for n in names if n[len(prefix):].split(".")[0].isdigit()]
        self.next_index = max(used) + 1 if used else 0
        self.manifest = JsonlAppender(store.root / "manifest" / f"rank-{rank:03d}.jsonl")
        self._lock = threading.Lock()

    def prepare(self, sid: str, input_ids: torch.Tensor, aux: torch.Tensor, last: torch.Tensor | None,
                aux_scale: torch.Tensor | None = None, finite: bool = False,
                labels: CompactLabels | None = None) -> PreparedSample:
        """Validate one sample and put it in storage form (FIELD_NOTES extraction rule 3).

        ``input_ids`` [T] int; ``aux`` [T, L, H] in the store dtype, or, for an fp8 store, either in the store
        dtype (quantised here) or already float8_e4m3fn with ``aux_scale`` float32 [T, L]; ``last`` [T, H] in the
        store dtype. ``finite=True``: the caller has checked every value is finite on the device (the capture
        backend does, where it costs nothing), so the CPU pass over the floats is skipped (fp8 scales are still
        checked). A top-k store (``label_format: topk``) takes ``labels`` (:class:`~eyas.store.labels.CompactLabels`
        of the T tokens, checked by :func:`~eyas.store.labels.check_labels`) instead of ``last``.
        Raises :class:`StoreError` naming the sample on a shape, dtype, label or finiteness problem.
        """
        h = self.store.header
        T = int(input_ids.shape[0])
        L, H = len(h.layer_ids), h.hidden_size
        dt = DTYPES[h.dtype]
        if h.topk:
            return self._prepare_topk(sid, input_ids, aux, aux_scale, finite, labels)
        if last is None:
            raise StoreError(f"sample {sid}: no last hidden state for a store that keeps it")
        if tuple(aux.shape) != (T, L, H) or tuple(last.shape) != (T, H):
            raise StoreError(f"sample {sid}: states shaped aux {tuple(aux.shape)}, last {tuple(last.shape)}; "
                             f"expected ({T}, {L}, {H}) and ({T}, {H})")
        if last.dtype != dt or aux.dtype not in (dt, h.aux_dtype):
            raise StoreError(f"sample {sid}: dtype {aux.dtype}/{last.dtype}, store holds {dt} (aux {h.aux_dtype})")
        if not finite and (not _all_finite(last) or (aux.dtype != FP8 and not _all_finite(aux))):
            raise StoreError(f"sample {sid}: non-finite hidden states")
        ids32 = input_ids.to(torch.int32).contiguous().cpu()
        aux, last = aux.contiguous().cpu(), last.contiguous().cpu()
        tensors = {"input_ids": ids32, **self._stored_aux(sid, aux, aux_scale, finite), "last": last}
        entry = ManifestEntry(sid, T, sample_checksum(*tensors.values()), list(aux.shape), list(last.shape), h.dtype)
        return PreparedSample(entry, tensors, sum(t.numel() * t.element_size() for t in tensors.values()))

    def _prepare_topk(self, sid: str, input_ids: torch.Tensor, aux: torch.Tensor, aux_scale: torch.Tensor | None,
                      finite: bool, labels: CompactLabels | None) -> PreparedSample:
        h = self.store.header
        T, L, H, k = int(input_ids.shape[0]), len(h.layer_ids), h.hidden_size, h.label_topk
        dt = DTYPES[h.dtype]
        if labels is None:
            raise StoreError(f"sample {sid}: the store keeps top-{k} labels, and none were made for it")
        if tuple(aux.shape) != (T, L, H) or aux.dtype not in (dt, h.aux_dtype):
            raise StoreError(f"sample {sid}: aux states {tuple(aux.shape)} {aux.dtype}; expected ({T}, {L}, {H}) "
                             f"{dt} (or {h.aux_dtype})")
        want = {"label_ids": ((T, k), label_id_dtype(h.draft_vocab_size)), "label_probs": ((T, k), PROB_DTYPE),
                "label_flags": ((T,), torch.uint8)}
        got = {"label_ids": labels.ids, "label_probs": labels.probs, "label_flags": labels.flags}
        for name, (shape, dtype) in want.items():
            if tuple(got[name].shape) != shape or got[name].dtype != dtype:
                raise StoreError(f"sample {sid}: {name} {tuple(got[name].shape)} {got[name].dtype}; expected "
                                 f"{shape} {dtype}")
        problem = check_labels(labels.ids, labels.probs, labels.flags, h.draft_vocab_size)
        if problem:
            raise StoreError(f"sample {sid}: {problem}")
        if not finite and aux.dtype != FP8 and not _all_finite(aux):
            raise StoreError(f"sample {sid}: non-finite hidden states")
        tensors = {"input_ids": input_ids.to(torch.int32).contiguous().cpu(),
                   **self._stored_aux(sid, aux.contiguous().cpu(), aux_scale, finite)}
        tensors.update({n: got[n].contiguous().cpu() for n in LABEL_TENSORS})
        entry = ManifestEntry(sid, T, sample_checksum(*tensors.values()), list(aux.shape), [T, k], h.dtype)
        return PreparedSample(entry, tensors, sum(t.numel() * t.element_size() for t in tensors.values()))

    def _stored_aux(self, sid: str, aux: torch.Tensor, aux_scale: torch.Tensor | None, finite: bool) -> dict:
        """The aux tensors as the store keeps them: ``{"aux": [T, L, H]}`` in the store's dtype, or for an fp8 store
        ``{"aux": fp8 [T, L, H], "aux_scale": float32 [T, L]}`` (quantised here unless already fp8). Raises
        :class:`StoreError` for a missing or misshapen scale, or non-finite values ``finite`` does not vouch for."""
        if not self.store.header.fp8:
            return {"aux": aux}
        T, L = int(aux.shape[0]), int(aux.shape[1])
        if aux.dtype != FP8:
            aux, aux_scale = quantize_fp8(aux)
        if aux_scale is None or tuple(aux_scale.shape) != (T, L) or aux_scale.dtype != torch.float32:
            raise StoreError(f"sample {sid}: fp8 aux needs aux_scale float32 [{T}, {L}]")
        # quantize_fp8 clamps finite values into range, so a device-checked sample cannot hold an fp8 NaN
        if not _all_finite(aux_scale) or (not finite and fp8_has_nan(aux)):
            raise StoreError(f"sample {sid}: non-finite hidden states")
        return {"aux": aux, "aux_scale": aux_scale.contiguous().cpu()}

    def append(self, p: PreparedSample) -> None:
        """Buffer a prepared sample for the next shard. Raises :class:`StoreError` for an id already stored."""
        sid = p.entry.id
        if sid in self.store or f"{sid}.input_ids" in self.buffer:
            raise StoreError(f"sample {sid} is already in the store")
        for k, t in p.tensors.items():
            self.buffer[f"{sid}.{k}"] = t
        self.entries.append(p.entry)
        self.buffered_bytes += p.nbytes

    def add(self, sid: str, input_ids: torch.Tensor, aux: torch.Tensor, last: torch.Tensor | None,
            aux_scale: torch.Tensor | None = None, labels: CompactLabels | None = None) -> None:
        """:meth:`prepare` then :meth:`append` (see there for shapes and errors)."""
        self.append(self.prepare(sid, input_ids, aux, last, aux_scale, labels=labels))

    def take(self) -> tuple[str, dict[str, torch.Tensor], list[ManifestEntry]] | None:
        """Hand over the buffered samples as ``(shard name, tensors, entries)`` for :meth:`write`, and start a new
        buffer. ``None`` when nothing is buffered."""
        if not self.entries:
            return None
        taken = (f"shard-R{self.rank:03d}-{self.next_index:06d}.safetensors", self.buffer, self.entries)
        self.next_index += 1
        self.buffer, self.entries, self.buffered_bytes = {}, [], 0
        return taken

    def write(self, taken: tuple[str, dict[str, torch.Tensor], list[ManifestEntry]]) -> ShardRecord:
        """Write one taken shard (temporary name, fsync, rename), then append and fsync its manifest line.
        Thread-safe: several shards may be written at once."""
        name, tensors, entries = taken
        head = safetensors_header(tensors, {"eyas_run_id": self.store.header.run_id})
        size = len(head)
        with atomic_path(self.store.root / "shards" / name) as tmp:
            with open(tmp, "wb") as f:
                f.write(head)
                for t in tensors.values():  # straight from the tensors' memory: no serialised copy of the shard
                    size += f.write(tensor_bytes(t))
        rec = ShardRecord(name, size, sha256_bytes(head), self.store.header.run_id, entries)
        with self._lock:
            self.manifest.append(rec.to_json())
            for e in rec.samples:
                self.store._index[e.id] = (name, e)
        return rec

    def commit(self) -> ShardRecord | None:
        """Write the buffered samples as one shard (atomic), then append and fsync its manifest line."""
        taken = self.take()
        return self.write(taken) if taken else None

    def close(self) -> None:
        """Commit what is buffered and close the manifest file (closed even when the commit fails)."""
        try:
            self.commit()
        finally:
            self.manifest.close()


def _all_finite(t: torch.Tensor) -> bool:
    # One fp32 reduction first (fast); NaN/inf propagate. Only an overflowing sum needs the exact elementwise check.
    if t.numel() == 0 or bool(torch.isfinite(t.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(t).all())
