"""``eyas doctor``: re-validate a hidden-state store completely, list what is wrong, and repair exactly that.

Checks (FIELD_NOTES, extraction rules 2-3), for a run directory or a store folder:
- the store header against the run (run id, target and tokenizer identity, layer ids, dtype, aux format), when
  the store belongs to a run directory; a mismatch makes the whole store *foreign*;
- every manifest line parses and names this run; every listed shard exists with the committed size and
  safetensors header (:meth:`HiddenStateStore.check_shard_structure`);
- every sample: its tensors exist with the manifest's and the header's shapes and dtypes, its sha256 checksum
  matches (every byte re-read), all values are finite, and, with a run, its id is a sample of the run's
  tokenized dataset (``tokenize/samples.jsonl``) and its stored token ids equal the dataset's;
- files in ``shards/`` that no manifest line lists (a crash between rename and manifest line, a temporary, or a
  file copied from another store) and samples listed twice.

Findings are ``missing`` (a dataset sample with no valid states), ``corrupt`` (damaged bytes or structure),
``foreign`` (another run's or another configuration's data, or a sample id not in the dataset), ``stale`` (token ids
differ from the dataset's), ``duplicate`` and ``orphan`` (unlisted files). ``--repair`` rewrites each manifest file
atomically without exactly the bad entries, deletes files that nothing lists any more, and re-extracts exactly the
samples that are then missing (:func:`eyas.store.extraction.extract_store`, the extract stage's own: same batch plan,
so the repaired store equals a clean run).
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import load_config
from ..dtypes import DTYPES
from ..errors import EyasError
from ..io import iter_jsonl, read_json, split_jsonl, write_json_atomic, write_text_atomic
from ..run_folder import RunFolder
from ..targets.weights import check_target
from .extraction import extract_store
from .fp8 import fp8_has_nan
from .header import expected_header
from .labels import PROB_DTYPE, check_labels, label_id_dtype
from .shards import HiddenStateStore, ManifestEntry, ShardRecord, read_header, sample_checksum, stored_tensor_names

KINDS = ("missing", "corrupt", "foreign", "stale", "duplicate", "orphan")


@dataclass
class Finding:
    """One problem: ``kind`` (one of :data:`KINDS`), the sample id and/or shard it concerns, and why."""

    kind: str
    reason: str
    sample: str | None = None
    shard: str | None = None
    where: str = ""  # manifest file:line

    def to_json(self) -> dict:
        """The finding without empty fields."""
        return {k: v for k, v in self.__dict__.items() if v not in (None, "")}


@dataclass
class DoctorReport:
    """What :func:`diagnose` found. ``drop``: manifest entries to remove, as ``{shard: {sample ids}}`` (``None`` =
    the whole record); ``bad_lines``: unparsable manifest lines ``{file name: {line numbers}}``."""

    store: Path
    run_dir: Path | None
    samples_ok: int = 0
    samples_listed: int = 0
    findings: list[Finding] = field(default_factory=list)
    drop: dict[str, set[str] | None] = field(default_factory=dict)
    bad_lines: dict[str, set[int]] = field(default_factory=dict)
    orphan_files: list[str] = field(default_factory=list)
    store_foreign: bool = False

    @property
    def clean(self) -> bool:
        """True when nothing was found."""
        return not self.findings

    def counts(self) -> dict[str, int]:
        """Findings per kind, every kind of :data:`KINDS` listed."""
        c = Counter(f.kind for f in self.findings)
        return {k: c.get(k, 0) for k in KINDS}

    def to_json(self, limit: int = 50) -> dict:
        """The report as JSON, with at most ``limit`` findings."""
        return {"store": str(self.store), "run_dir": str(self.run_dir) if self.run_dir else None,
                "samples_listed": self.samples_listed, "samples_ok": self.samples_ok, "counts": self.counts(),
                "findings": [f.to_json() for f in self.findings[:limit]],
                "findings_left_out": max(0, len(self.findings) - limit)}

    def _add(self, kind: str, reason: str, sample: str | None = None, shard: str | None = None,
             where: str = "") -> None:
        self.findings.append(Finding(kind, reason, sample, shard, where))
        if shard is not None and kind != "missing":
            if sample is None:
                self.drop[shard] = None
            elif self.drop.get(shard, set()) is not None:
                self.drop.setdefault(shard, set()).add(sample)


def locate(path: Path) -> tuple[Path | None, Path]:
    """``(run_dir or None, store folder)`` for a run directory or a store folder; raises :class:`EyasError`."""
    path = Path(path)
    if (path / "store.json").exists():
        run = RunFolder(path.parent.parent)
        return (run.root if run.is_run() and run.store.resolve() == path.resolve() else None), path
    if RunFolder(path).is_run():
        return path, RunFolder(path).store
    raise EyasError(f"{path}: neither a run directory (run.json) nor a hidden-state store (store.json)")


def _read_records(store: HiddenStateStore, report: DoctorReport) -> list[ShardRecord]:
    recs = []
    for mf in store.manifest_files():
        lines, torn = split_jsonl(mf.read_bytes())
        for lineno, line in enumerate(lines + [torn], 1):
            if not line.strip():
                continue
            where = f"{mf.name}:{lineno}"
            try:
                if lineno > len(lines):
                    raise ValueError("torn last line (no newline)")
                d = json.loads(line)
                recs.append(ShardRecord(d["shard"], int(d["bytes"]), d["header_sha256"], d.get("run_id", "?"),
                                        [ManifestEntry(**e) for e in d["samples"]], where))
            except (ValueError, KeyError, TypeError) as e:
                report.findings.append(Finding("corrupt", f"manifest line unreadable ({e})", where=where))
                report.bad_lines.setdefault(mf.name, set()).add(lineno)
    return recs


def _check_sample(f, e: ManifestEntry, header, dataset: dict | None) -> tuple[str, str] | None:
    """``(kind, reason)`` for a bad sample, ``None`` when it passes every check."""
    L, H, k = len(header.layer_ids), header.hidden_size, header.label_topk
    names = stored_tensor_names(header)
    want = {"input_ids": ((e.tokens,), torch.int32), "aux": ((e.tokens, L, H), header.aux_dtype),
            "aux_scale": ((e.tokens, L), torch.float32), "last": ((e.tokens, H), DTYPES[header.dtype]),
            "label_ids": ((e.tokens, k), label_id_dtype(header.draft_vocab_size)),
            "label_probs": ((e.tokens, k), PROB_DTYPE), "label_flags": ((e.tokens,), torch.uint8)}
    last_shape = [e.tokens, k] if header.topk else [e.tokens, H]
    if list(e.aux_shape) != [e.tokens, L, H] or list(e.last_shape) != last_shape or e.dtype != header.dtype:
        return "corrupt", f"manifest shapes {e.aux_shape}/{e.last_shape} ({e.dtype}) disagree with the header"
    try:
        t = {n: f.get_tensor(f"{e.id}.{n}") for n in names}
    except Exception as ex:  # missing tensor or unreadable bytes
        return "corrupt", f"tensor unreadable ({type(ex).__name__}: {ex})"
    for n in names:
        shape, dtype = want[n]
        if tuple(t[n].shape) != shape or t[n].dtype != dtype:
            return "corrupt", f"{n} is {t[n].dtype} {tuple(t[n].shape)}, expected {dtype} {shape}"
    if sample_checksum(*(t[n] for n in names)) != e.checksum:
        return "corrupt", "checksum mismatch (bytes changed after commit)"
    floats = ([] if header.topk else [t["last"]]) + ([t["aux_scale"]] if header.fp8 else [t["aux"]])
    if any(not bool(torch.isfinite(x).all()) for x in floats) or (header.fp8 and fp8_has_nan(t["aux"])):
        return "corrupt", "non-finite hidden states"
    if header.topk:
        problem = check_labels(t["label_ids"], t["label_probs"], t["label_flags"], header.draft_vocab_size)
        if problem:
            return "corrupt", problem
    if dataset is not None and t["input_ids"].tolist() != dataset[e.id]:
        return "stale", "stored token ids differ from the tokenized dataset's (computed from other tokens)"
    return None


def diagnose(path: Path) -> DoctorReport:
    """Re-validate everything in the store at ``path`` (run directory or store folder); see the module doc.

    Raises :class:`EyasError` when ``path`` is neither; every problem inside the store is a finding, not an error.
    """
    run_dir, root = locate(path)
    report = DoctorReport(store=root, run_dir=run_dir)
    dataset = None
    if run_dir is not None:
        dataset = {d["id"]: d["input_ids"] for _, d in iter_jsonl(RunFolder(run_dir).tokenized)}
    if not (root / "store.json").exists():
        for sid in dataset or {}:
            report._add("missing", "no hidden-state store yet", sample=sid)
        return report
    header = read_header(root / "store.json")
    if run_dir is not None:
        cfg = load_config(RunFolder(run_dir).config_yaml)
        expected = expected_header(cfg.target, cfg.extract, RunFolder(run_dir))
        diff = [k for k, v in expected.identity().items() if header.identity().get(k) != v]
        if diff:
            report.store_foreign = True
            report.findings.append(Finding("foreign", f"store header differs from this run's configuration in: "
                                                      f"{', '.join(diff)}"))
    store = HiddenStateStore(root, header)
    records = _read_records(store, report)
    listed_files = {r.shard for r in records}
    valid: set[str] = set()
    for rec in records:
        report.samples_listed += len(rec.samples)
        if report.store_foreign:
            report.drop[rec.shard] = None
            continue
        problem = store.check_shard_structure(rec)
        if problem:
            kind = "foreign" if "foreign" in problem else "corrupt"
            report._add(kind, f"shard {problem}", shard=rec.shard, where=rec.manifest)
            continue
        try:
            f = safe_open(str(root / "shards" / rec.shard), framework="pt")
        except Exception as ex:  # noqa: BLE001 - any unreadable file is a finding
            report._add("corrupt", f"shard unreadable ({ex})", shard=rec.shard, where=rec.manifest)
            continue
        for e in rec.samples:
            if dataset is not None and e.id not in dataset:
                report._add("foreign", "sample id is not in the run's tokenized dataset", e.id, rec.shard,
                            rec.manifest)
                continue
            if e.id in valid:
                report._add("duplicate", "sample listed again (an earlier copy is valid)", e.id, rec.shard,
                            rec.manifest)
                continue
            bad = _check_sample(f, e, header, dataset)
            if bad:
                report._add(bad[0], bad[1], e.id, rec.shard, rec.manifest)
            else:
                valid.add(e.id)
        del f
    sdir = root / "shards"
    for p in sorted(sdir.iterdir()) if sdir.exists() else []:
        if p.name not in listed_files:
            report.orphan_files.append(p.name)
            report.findings.append(Finding("orphan", "file not listed in any manifest (crash leftover, temporary "
                                                     "or copied from another store)", shard=p.name))
    report.samples_ok = len(valid)
    for sid in dataset or {}:
        if sid not in valid:
            report._add("missing", "no valid hidden states", sample=sid)
    return report


def repair(report: DoctorReport, log=print) -> DoctorReport:
    """Drop exactly the bad entries found by :func:`diagnose` (each manifest file rewritten atomically), delete
    files nothing lists any more, re-extract the missing samples with the extract stage, and diagnose again.

    Raises :class:`EyasError` for a store outside a run directory (nothing to re-extract from).
    """
    if report.run_dir is None:
        raise EyasError(f"{report.store}: --repair needs the run directory the store belongs to "
                        f"(its tokenized dataset and config); this store is not inside one")
    run = RunFolder(report.run_dir)
    cfg = load_config(run.config_yaml)
    check_target(cfg.target, "doctor --repair loads its weights to re-extract")   # before anything is rewritten
    root = report.store
    if report.store_foreign:
        log(f"[eyas] doctor: {root} belongs to another run or configuration: removing it to re-extract")
        shutil.rmtree(root)
    elif (root / "store.json").exists():
        kept_files: set[str] = set()
        for mf in sorted((root / "manifest").glob("rank-*.jsonl")):
            lines = mf.read_bytes().split(b"\n")
            out = []
            for lineno, line in enumerate(lines, 1):
                if not line.strip() or lineno in report.bad_lines.get(mf.name, set()):
                    continue
                d = json.loads(line)
                drop = report.drop.get(d["shard"], set())
                if drop is None:
                    continue
                d["samples"] = [e for e in d["samples"] if e["id"] not in drop]
                if d["samples"]:
                    out.append(json.dumps(d, ensure_ascii=False) + "\n")
                    kept_files.add(d["shard"])
            write_text_atomic(mf, "".join(out))
        for p in sorted((root / "shards").iterdir()):
            if p.name not in kept_files:
                p.unlink()
        c = report.counts()
        log(f"[eyas] doctor: manifest rewritten without {c['corrupt'] + c['foreign'] + c['stale'] + c['duplicate']} "
            f"bad findings, {len(report.orphan_files)} unlisted files deleted; re-extracting {c['missing']} "
            f"missing samples")
    summary = extract_store(cfg.target, cfg.extract, run, log)
    if run.done("extract").exists():
        write_json_atomic(run.done("extract"), {**read_json(run.done("extract")), "summary": summary.to_json()})
    return diagnose(report.run_dir)

