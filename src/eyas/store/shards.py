"""Hidden-state store: safetensors shards keyed by sample id, plus a manifest that is the only source of truth.

Layout of a store folder::

    store.json                       StoreHeader: run id, target/tokenizer identity, layer ids + convention, dtype...
    shards/shard-R{rank:03d}-{n:06d}.safetensors
    manifest/rank-{rank:03d}.jsonl   one line per committed shard: its file size, sha256, and per-sample entries

Tensors of sample ``sid`` inside a shard (T tokens, H target hidden size, L = 3 aux layers):
- ``{sid}.input_ids`` int32 [T]   token ids the states were computed from;
- ``{sid}.aux``       dtype [T, L, H]  aux hidden states (outputs of the aux layers, ``output_of_layer`` ids);
- ``{sid}.last``      dtype [T, H]     last hidden state, after the final norm (as SGLang / HF / SpecForge).

Commit protocol: a shard is written under a temporary name, fsynced and renamed; only then is its manifest line
appended and fsynced. A shard without a manifest line (crash between the two) is an orphan: it is deleted on
resume and its samples are extracted again. Resume trusts the manifest only after checking each listed shard's
size and header against it; :func:`eyas.store.doctor` re-hashes everything.

Each sample's checksum is sha256 over its three tensors' raw bytes (input_ids, aux, last, in that order).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from ..errors import StoreError
from ..io import JsonlAppender, atomic_path, iter_jsonl, read_json, sha256_bytes, write_json_atomic

FORMAT_VERSION = 1
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class StoreHeader:
    """What a store was made from. Two stores (or a store and a run) match only when every field matches."""

    run_id: str
    target: dict            # {"path", "config_sha256", "num_layers", "hidden_size"}
    tokenizer: dict         # {"name_or_path", "vocab_size", "chat_template_sha256"}
    layer_ids: list[int]
    layer_convention: str   # always "output_of_layer" in an Eyas store
    last_hidden: str        # "post_norm"
    hidden_size: int
    dtype: str
    engine: dict            # {"name": "transformers", "version": ...}
    format_version: int = FORMAT_VERSION

    # Fields that may differ between runs that extract the same content (where it ran, with which engine).
    _IDENTITY_EXEMPT = ("engine",)

    def identity(self) -> dict:
        d = asdict(self)
        for k in self._IDENTITY_EXEMPT:
            d.pop(k)
        return d


@dataclass
class SampleStates:
    """One sample read back: ``input_ids`` int32 [T], ``aux`` [T, L, H], ``last`` [T, H]."""

    id: str
    input_ids: torch.Tensor
    aux: torch.Tensor
    last: torch.Tensor


@dataclass
class ManifestEntry:
    id: str
    tokens: int
    checksum: str
    aux_shape: list[int]
    last_shape: list[int]
    dtype: str


@dataclass
class ShardRecord:
    shard: str
    bytes: int
    sha256: str
    samples: list[ManifestEntry] = field(default_factory=list)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a tensor in its own dtype (bf16 included), C order."""
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def sample_checksum(input_ids: torch.Tensor, aux: torch.Tensor, last: torch.Tensor) -> str:
    return sha256_bytes(tensor_bytes(input_ids), tensor_bytes(aux), tensor_bytes(last))


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
            old = StoreHeader(**read_json(hpath))
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
        store = cls(root, StoreHeader(**read_json(hpath)))
        store._load_manifest()
        return store

    def manifest_records(self) -> list[ShardRecord]:
        """Every committed shard record, all ranks, in file order."""
        recs = []
        mdir = self.root / "manifest"
        for mf in sorted(mdir.glob("rank-*.jsonl")) if mdir.exists() else []:
            for _, d in iter_jsonl(mf):
                recs.append(ShardRecord(d["shard"], d["bytes"], d["sha256"],
                                        [ManifestEntry(**e) for e in d["samples"]]))
        return recs

    def _load_manifest(self) -> None:
        self._index.clear()
        for rec in self.manifest_records():
            for e in rec.samples:
                if e.id in self._index:
                    raise StoreError(f"{self.root}: sample {e.id} is listed twice in the manifest")
                self._index[e.id] = (rec.shard, e)

    # ---------------------------------------------------------------- resume
    def validate_for_resume(self) -> dict:
        """Check every manifest-listed shard's size and header; delete orphans and temporaries.

        Returns counts. Raises :class:`StoreError` for a listed shard that is missing, truncated or whose header
        disagrees with the manifest: run ``eyas doctor --repair`` for those.
        """
        listed = {rec.shard: rec for rec in self.manifest_records()}
        sdir = self.root / "shards"
        removed = 0
        for p in sorted(sdir.iterdir()) if sdir.exists() else []:
            if p.name not in listed:  # orphan (crash before the manifest line) or a temporary file
                p.unlink()
                removed += 1
        for name, rec in listed.items():
            problem = self.check_shard_structure(rec)
            if problem:
                raise StoreError(f"{sdir / name}: {problem}. Run `eyas doctor RUN --repair` to re-extract it.")
        return {"shards": len(listed), "samples": len(self._index), "orphans_removed": removed}

    def check_shard_structure(self, rec: ShardRecord) -> str | None:
        """A cheap check of one shard against its manifest record (size, tensor names, shapes, dtypes)."""
        path = self.root / "shards" / rec.shard
        if not path.exists():
            return "listed in the manifest but missing"
        if path.stat().st_size != rec.bytes:
            return f"size {path.stat().st_size} differs from the manifest's {rec.bytes} (truncated or replaced)"
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = set(f.keys())
                for e in rec.samples:
                    for suffix, shape in (("aux", e.aux_shape), ("last", e.last_shape), ("input_ids", [e.tokens])):
                        k = f"{e.id}.{suffix}"
                        if k not in keys:
                            return f"tensor {k} missing"
                        if list(f.get_slice(k).get_shape()) != list(shape):
                            return f"tensor {k} has shape {f.get_slice(k).get_shape()}, manifest says {shape}"
        except Exception as ex:  # unreadable header
            return f"unreadable safetensors header ({ex})"
        return None

    # ---------------------------------------------------------------- writing
    def shard_writer(self, rank: int = 0) -> "ShardWriter":
        return ShardWriter(self, rank)

    # ---------------------------------------------------------------- reading
    def __contains__(self, sid: str) -> bool:
        return sid in self._index

    def __len__(self) -> int:
        return len(self._index)

    def ids(self) -> list[str]:
        return list(self._index)

    def entry(self, sid: str) -> ManifestEntry:
        return self._index[sid][1]

    def read(self, sid: str) -> SampleStates:
        """Random access to one sample (memory-mapped). Raises KeyError for an unknown id."""
        shard, _ = self._index[sid]
        f = self._handles.get(shard)
        if f is None:
            f = safe_open(str(self.root / "shards" / shard), framework="pt")
            self._handles[shard] = f
        return SampleStates(sid, f.get_tensor(f"{sid}.input_ids"), f.get_tensor(f"{sid}.aux"),
                            f.get_tensor(f"{sid}.last"))


class ShardWriter:
    """Buffers samples and commits them as shards (atomic rename, then manifest line)."""

    def __init__(self, store: HiddenStateStore, rank: int):
        self.store = store
        self.rank = rank
        self.buffer: dict[str, torch.Tensor] = {}
        self.entries: list[ManifestEntry] = []
        self.buffered_bytes = 0
        existing = sorted((store.root / "shards").glob(f"shard-R{rank:03d}-*.safetensors"))
        self.next_index = (int(existing[-1].stem.split("-")[-1]) + 1) if existing else 0
        self.manifest = JsonlAppender(store.root / "manifest" / f"rank-{rank:03d}.jsonl")

    def add(self, sid: str, input_ids: torch.Tensor, aux: torch.Tensor, last: torch.Tensor) -> None:
        """Validate and buffer one sample: ``input_ids`` [T] int, ``aux`` [T, L, H], ``last`` [T, H].

        Raises :class:`StoreError` on a shape, dtype or finiteness problem (FIELD_NOTES extraction rule 3).
        """
        h = self.store.header
        T = int(input_ids.shape[0])
        L, H = len(h.layer_ids), h.hidden_size
        dt = DTYPES[h.dtype]
        if tuple(aux.shape) != (T, L, H) or tuple(last.shape) != (T, H):
            raise StoreError(f"sample {sid}: states shaped aux {tuple(aux.shape)}, last {tuple(last.shape)}; "
                             f"expected ({T}, {L}, {H}) and ({T}, {H})")
        if aux.dtype != dt or last.dtype != dt:
            raise StoreError(f"sample {sid}: dtype {aux.dtype}/{last.dtype}, store holds {dt}")
        if not (torch.isfinite(aux).all() and torch.isfinite(last).all()):
            raise StoreError(f"sample {sid}: non-finite hidden states")
        if sid in self.store or sid in {e.id for e in self.entries}:
            raise StoreError(f"sample {sid} is already in the store")
        ids32 = input_ids.to(torch.int32).contiguous().cpu()
        aux, last = aux.contiguous().cpu(), last.contiguous().cpu()
        self.buffer[f"{sid}.input_ids"] = ids32
        self.buffer[f"{sid}.aux"] = aux
        self.buffer[f"{sid}.last"] = last
        self.entries.append(ManifestEntry(sid, T, sample_checksum(ids32, aux, last), list(aux.shape),
                                          list(last.shape), h.dtype))
        self.buffered_bytes += aux.numel() * aux.element_size() + last.numel() * last.element_size() + 4 * T

    def commit(self) -> ShardRecord | None:
        """Write the buffered samples as one shard (atomic), then append and fsync its manifest line."""
        if not self.entries:
            return None
        name = f"shard-R{self.rank:03d}-{self.next_index:06d}.safetensors"
        final = self.store.root / "shards" / name
        data = save(self.buffer, metadata={"eyas_run_id": self.store.header.run_id})
        with atomic_path(final) as tmp:
            tmp.write_bytes(data)
        rec = ShardRecord(name, len(data), sha256_bytes(data), self.entries)
        self.manifest.append({"shard": rec.shard, "bytes": rec.bytes, "sha256": rec.sha256,
                              "samples": [asdict(e) for e in rec.samples]})
        for e in rec.samples:
            self.store._index[e.id] = (name, e)
        self.next_index += 1
        self.buffer, self.entries, self.buffered_bytes = {}, [], 0
        return rec

    def close(self) -> None:
        self.commit()
        self.manifest.close()
