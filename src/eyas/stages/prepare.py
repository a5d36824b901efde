"""prepare: read every source, normalise roles and turns, de-duplicate by stable sample id.

Writes ``prepare/conversations.jsonl`` (one :class:`~eyas.records.Conversation` per line) and
``prepare/report.json`` (rows read/kept/skipped per source, skip reasons with file:line and field, duplicates).
"""

from __future__ import annotations

from ..data.formats import load_source
from ..io import JsonlAppender, write_json_atomic
from ..records import SkipCounter, SkipRecord
from . import RunContext


def run(ctx: RunContext) -> dict:
    cfg = ctx.cfg.prepare
    out_dir = ctx.stage_dir("prepare")
    out = out_dir / "conversations.jsonl"
    out.unlink(missing_ok=True)  # prepare is cheap and deterministic: always rebuilt whole
    skips = SkipCounter()
    seen: set[str] = set()
    per_source = []
    kept = duplicates = 0
    with JsonlAppender(out, fsync_every=1 << 30) as w:
        for src in cfg.sources:
            stats: dict = {}
            for conv in load_source(src, skips, stats):
                if conv.id in seen:
                    duplicates += 1
                    skips.add(SkipRecord(conv.source, "duplicate conversation (same sample id)"))
                    continue
                if cfg.max_samples is not None and kept >= cfg.max_samples:
                    stats["rows_over_max_samples"] = stats.get("rows_over_max_samples", 0) + 1
                    continue
                seen.add(conv.id)
                w.append(conv.to_json())
                kept += 1
            per_source.append({"path": src.path, **stats})
            ctx.log(
                f"[eyas] prepare: {src.path}: {stats['rows_read']} rows read, {stats['rows_kept']} kept, "
                f"{stats['rows_skipped']} skipped"
            )
    report = {
        "samples": kept,
        "duplicates": duplicates,
        "sources": per_source,
        "skips": skips.to_json(),
    }
    write_json_atomic(out_dir / "report.json", report)
    if skips.total:
        top = ", ".join(f"{n} x {r}" for r, n in sorted(skips.counts.items(), key=lambda x: -x[1])[:5])
        ctx.log(f"[eyas] prepare: {skips.total} skips/merges ({top}); details in {out_dir / 'report.json'}")
    return {"samples": kept, "duplicates": duplicates, "skipped": skips.total}
