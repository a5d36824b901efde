"""prepare: read every source, normalise roles and turns, de-duplicate by stable sample id, report on the data.

Writes ``prepare/conversations.jsonl`` (one :class:`~eyas.records.Conversation` per line), ``prepare/report.json``
and ``prepare/token_lengths.png``.

The report, per source: ``rows_read == rows_kept + rows_skipped`` (duplicates of an earlier sample and rows over
``prepare.max_samples`` count as skipped, each with its reason in ``skipped_by_reason``), turns written by role,
turn-level changes (empty turns dropped, same-role turns merged, leading assistant turns dropped), the assistant
turns that carry reasoning (``reasoning``: in a ``reasoning_content``/``reasoning`` field, or inline as a ``<think>``
block in the content) and token-length statistics; ``totals`` sums the sources and ``totals.rows_kept == samples``.
Examples of every skip and change name their file:line (or ``file:row N``) and field under ``skips``. A source that
yields no conversation is listed under ``empty_sources`` and warned about; when no source yields one, the stage fails
(:class:`DataError`) with each source's counts and skip reasons, instead of handing nothing to the stages after it.

Token lengths are counted here, with the target's own tokenizer (it loads in about a second; a GGUF target is
converted once, as generate needs it anyway): per conversation, the tokens of its turns' texts without the chat
template, so template tokens (a few per turn) are not included; tokenize reports the exact rendered lengths and its
truncations. That is why prepare depends on the ``target`` section.
"""

from __future__ import annotations

import math
import time

from ..data.formats import load_source, reasoning_kind
from ..data.mix import NearDuplicateFilter, NgramIndex, choose, language_filter
from ..errors import ConfigError, DataError
from ..io import JsonlAppender, atomic_path, write_json_atomic
from ..records import Conversation, SkipCounter, SkipRecord
from ..summaries import PrepareSummary
from ..targets.load import load_tokenizer
from . import RunContext

READS = ("prepare", "target")  # target: its tokenizer counts the report's tokens (and it writes the self-prompts)
INPUTS = ()

DUPLICATE = "duplicate conversation (same sample id)"
CONTAMINATED = "overlaps an evaluation prompt (prepare.decontaminate)"
NEAR_DUPLICATE = "near-duplicate of an earlier conversation (prepare.near_duplicates)"
MIX = "left out by the source's weight or caps (the mix)"
SELF = "self-prompts (written by the target)"
OVER_MAX = "over prepare.max_samples"


def reads_target_weights(cfg) -> bool:
    """The target's weights are loaded only to write self-prompts; the report's tokens need its tokenizer only."""
    return cfg.prepare.self_prompts is not None


def _self_prompts(ctx: RunContext, skips: SkipCounter, stats: dict):
    """``prepare.self_prompts``: user turns the target samples from its own template (Magpie), as one-turn
    conversations (source ``self-prompts:i``); the rows ``stats`` counts are the prompts asked for."""
    from ..config import GenerateConfig
    from ..generation.inprocess import make_engine
    from ..generation.self_prompts import sample_self_prompts
    from ..records import Message
    from ..targets.load import load_target

    sp = ctx.cfg.prepare.self_prompts
    target = load_target(ctx.cfg.target)
    gen = GenerateConfig(max_new_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed,
                         batch_size=sp.batch_size)
    engine = make_engine(target.model, target.tokenizer, gen, prompt_limit=512, log=ctx.log)
    t0 = time.perf_counter()
    try:
        prompts, st = sample_self_prompts(engine, target.tokenizer, sp.count, max_tokens=sp.max_tokens,
                                          chat_template_kwargs=sp.chat_template_kwargs or None,
                                          min_chars=sp.min_chars, system_prompts=sp.system_prompts)
    except ValueError as e:
        raise ConfigError(f"prepare.self_prompts: {e}") from e
    seconds = time.perf_counter() - t0
    too_long = lang_out = 0
    if sp.max_chars is not None:
        too_long = sum(len(p) > sp.max_chars for p in prompts)
        prompts = [p for p in prompts if len(p) <= sp.max_chars]
    if sp.languages:
        keep = language_filter(prompts, set(sp.languages), seed=sp.seed)
        lang_out = len(prompts) - sum(keep)
        prompts = [p for p, k in zip(prompts, keep) if k]
    dropped = {f"not ended within prepare.self_prompts.max_tokens ({sp.max_tokens})": st.cut,
               f"empty or shorter than {sp.min_chars} characters": st.empty,
               "repeats an earlier self-prompt": st.repeated,
               f"longer than prepare.self_prompts.max_chars ({sp.max_chars})": too_long,
               f"not in prepare.self_prompts.languages {sp.languages}": lang_out}
    for reason, n in dropped.items():
        for _ in range(n):
            skips.add(SkipRecord("self-prompts", reason))
    stats.update(rows_read=st.asked, rows_kept=len(prompts), rows_skipped=st.asked - len(prompts),
                 skipped_by_reason={r: n for r, n in dropped.items() if n}, seconds=round(seconds, 2),
                 prompts_per_minute=round(st.kept / seconds * 60, 1) if seconds > 0 else None)
    if st.kept_by_system is not None:   # ended and distinct, before the length and language filters
        stats["kept_by_system_prompt"] = [{"system_prompt": s, "kept": k}
                                          for s, k in zip(sp.system_prompts, st.kept_by_system)]
    ctx.log(f"[eyas] prepare: self-prompts: {st.asked} asked, {st.kept} ended and distinct in {seconds:.1f} s "
            f"({stats['prompts_per_minute']} a minute), {len(prompts)} kept after the length and language filters")
    for i, text in enumerate(prompts, 1):
        msgs = [Message("user", text)]
        yield Conversation(id=Conversation.make_id(msgs), messages=msgs, source=f"self-prompts:{i}")


def run(ctx: RunContext) -> PrepareSummary:
    cfg = ctx.cfg.prepare
    out = ctx.run.prepared
    out.unlink(missing_ok=True)  # prepare is cheap and deterministic: always rebuilt whole
    tok = load_tokenizer(ctx.cfg.target)
    # The first stage that knows the target refuses a drafter no engine would serve (layers, vocabulary, formats).
    skips = SkipCounter()
    seen: set[str] = set()
    per_source = []
    lengths: dict[str, list[int]] = {}
    kept = duplicates = 0
    decon = _eval_index(cfg.decontaminate, ctx) if cfg.decontaminate else None
    near = NearDuplicateFilter(cfg.near_duplicates.threshold, cfg.near_duplicates.num_perm) \
        if cfg.near_duplicates else None
    readers = [(src.path, src.format, src, lambda sk, st, src=src: load_source(src, sk, st)) for src in cfg.sources]
    if cfg.self_prompts is not None:
        readers.append((SELF, "self", None, lambda sk, st: _self_prompts(ctx, sk, st)))
    with JsonlAppender(out, fsync_every=1 << 30) as w:
        for path, fmt, src, read in readers:
            stats: dict = {}
            src_skips = SkipCounter()
            candidates: list[Conversation] = []
            for conv in read(src_skips, stats):
                reason = None
                if conv.id in seen:
                    reason = DUPLICATE
                    duplicates += 1
                elif decon is not None and (hit := decon.match(
                        m.content for m in conv.messages if m.role != "assistant")) is not None:
                    reason = f"{CONTAMINATED} ({hit[0]})"
                    src_skips.add(SkipRecord(conv.source, reason, f"shares '{hit[1]}'"))
                elif near is not None and (twin := near.seen(conv.id, _user_text(conv))) is not None:
                    reason = NEAR_DUPLICATE
                    src_skips.add(SkipRecord(conv.source, reason, f"like {twin}"))
                if reason is not None:
                    _skip_kept_row(stats, src_skips, SkipRecord(conv.source, reason),
                                   counted=reason != DUPLICATE)
                    continue
                seen.add(conv.id)
                candidates.append(conv)
            sizes = _token_lengths(tok, candidates) if src is not None and src.max_tokens else None
            chosen, dropped = choose(len(candidates), seed=cfg.seed, salt=path,
                                     weight=src.weight if src else None,
                                     max_items=src.max_conversations if src else None,
                                     sizes=sizes, max_size=src.max_tokens if src else None)
            keep = set(chosen)
            written: list[Conversation] = []
            for i, conv in enumerate(candidates):
                reason = None if i in keep else MIX
                if reason is None and cfg.max_samples is not None and kept >= cfg.max_samples:
                    reason = OVER_MAX
                if reason is not None:
                    _skip_kept_row(stats, src_skips, SkipRecord(conv.source, reason))
                    continue
                w.append(conv.to_json())
                written.append(conv)
                kept += 1
            _merge(skips, src_skips)
            row_reasons = set(stats["skipped_by_reason"])
            by_role: dict[str, int] = {}
            reasoning = {"assistant_turns": 0, "from_reasoning_field": 0, "inline_think": 0}
            for c in written:
                for m in c.messages:
                    by_role[m.role] = by_role.get(m.role, 0) + 1
                    kind = reasoning_kind(m)
                    if kind is not None:
                        reasoning["assistant_turns"] += 1
                        reasoning["from_reasoning_field" if kind == "field" else "inline_think"] += 1
            lengths[path] = _token_lengths(tok, written)
            entry = {
                "path": path, "format": fmt,
                "rows_read": stats["rows_read"], "rows_kept": stats["rows_kept"],
                "rows_skipped": stats["rows_skipped"], "skipped_by_reason": stats["skipped_by_reason"],
                "turns": sum(by_role.values()), "turns_by_role": by_role,
                "turn_changes": {r: n for r, n in sorted(src_skips.counts.items()) if r not in row_reasons},
                "reasoning": reasoning,
                "token_lengths": _summary(lengths[path]),
            }
            if dropped:
                entry["mix_dropped"] = dropped
            if "seconds" in stats:
                entry["self_prompts"] = {k: stats[k] for k in ("seconds", "prompts_per_minute", "kept_by_system_prompt")
                                         if k in stats}
            per_source.append(entry)
            ctx.log(
                f"[eyas] prepare: {path}: {stats['rows_read']} rows read, {stats['rows_kept']} kept, "
                f"{stats['rows_skipped']} skipped"
            )
            if reasoning["assistant_turns"]:
                ctx.log(f"[eyas] prepare: {path}: reasoning kept on {reasoning['assistant_turns']} assistant turns "
                        f"({reasoning['from_reasoning_field']} from reasoning_content or reasoning, "
                        f"{reasoning['inline_think']} inline <think> in the content)")
    totals = {k: sum(s[k] for s in per_source) for k in ("rows_read", "rows_kept", "rows_skipped", "turns")}
    totals["reasoning"] = {k: sum(s["reasoning"][k] for s in per_source) for k in per_source[0]["reasoning"]} \
        if per_source else {}
    all_lengths = [n for v in lengths.values() for n in v]
    png = ctx.run.token_lengths_png
    plotted = _plot_histogram(lengths, png, str(tok.name_or_path), ctx)
    mix = mix_table(per_source)
    report = {
        "samples": kept,
        "duplicates": duplicates,
        "totals": {**totals, "token_lengths": _summary(all_lengths)},
        "token_lengths_counted_with": {"tokenizer": str(tok.name_or_path),
                                       "what": "tokens of each conversation's turn texts (reasoning included), chat "
                                               "template excluded"},
        "token_length_histogram": png.name if plotted else None,
        "mix": mix,
        "decontaminated_against": decon.labels if decon is not None else None,
        "sources": per_source,
        "skips": skips.to_json(),
    }
    empty = [s for s in per_source if s["rows_kept"] == 0]
    report["empty_sources"] = [s["path"] for s in empty]
    write_json_atomic(ctx.run.prepare_report, report)
    ctx.log("[eyas] prepare: the mix training will see (conversations, user turns, turn-text tokens):\n"
            + format_mix(mix))
    if skips.total:
        top = ", ".join(f"{n} x {r}" for r, n in sorted(skips.counts.items(), key=lambda x: -x[1])[:5])
        ctx.log(f"[eyas] prepare: {skips.total} skips/merges ({top}); details in {ctx.run.prepare_report}")
    if kept == 0:
        raise DataError("prepare: no conversation to train on; every source yielded nothing:\n"
                        + "\n".join(f"  {source_counts(s)}" for s in per_source)
                        + f"\n(details in {ctx.run.prepare_report}; set each source's format if it was not detected)")
    for s in empty:
        ctx.log(f"[eyas] prepare: warning: source yielded no conversation: {source_counts(s)}")
    return PrepareSummary(samples=kept, duplicates=duplicates, skipped=totals["rows_skipped"],
                          tokens=sum(all_lengths))


def _user_text(conv: Conversation) -> str:
    """What near-duplicate removal compares: the conversation's user turns, in order."""
    return "\n".join(m.content for m in conv.messages if m.role == "user")


def _eval_index(dc, ctx: RunContext) -> NgramIndex:
    """The prompts (user and system turns) of every row of ``prepare.decontaminate.sets`` in one n-gram index,
    labelled by file name (``index.labels``: rows read per file). Training rows are matched on their prompts too:
    their replies are the target's own after generate, not the dataset's."""
    index = NgramIndex(dc.ngram)
    for src in dc.sets:
        label = src.path.rsplit("/", 1)[-1]
        n = 0
        for conv in load_source(src, SkipCounter(), {}):
            for m in conv.messages:
                if m.role != "assistant":  # the prompts: a set's reference answers are not what it asks
                    index.add(m.content, label)
            n += 1
        index.labels[label] = index.labels.get(label, 0) + n
        ctx.log(f"[eyas] prepare: decontaminating against {src.path} ({n} rows, {dc.ngram}-word n-grams)")
    return index


def mix_table(per_source: list[dict]) -> list[dict]:
    """Per source: conversations, user turns and turn-text tokens kept, each with its share of the whole."""
    rows = [{"source": s["path"], "conversations": s["rows_kept"], "user_turns": s["turns_by_role"].get("user", 0),
             "tokens": s["token_lengths"].get("total", 0)} for s in per_source]
    for key in ("conversations", "user_turns", "tokens"):
        total = sum(r[key] for r in rows) or 1
        for r in rows:
            r[f"{key}_share"] = round(r[key] / total, 4)
    return rows


def format_mix(mix: list[dict]) -> str:
    width = max([len(r["source"].rsplit("/", 1)[-1]) for r in mix] + [6])
    lines = [f"  {'source':<{width}} {'conversations':>15} {'user turns':>15} {'tokens':>17}"]
    for r in mix:
        lines.append(f"  {r['source'].rsplit('/', 1)[-1]:<{width}} {r['conversations']:>8,} {r['conversations_share']:>6.1%} "
                     f"{r['user_turns']:>8,} {r['user_turns_share']:>6.1%} {r['tokens']:>10,} {r['tokens_share']:>6.1%}")
    return "\n".join(lines)


def source_counts(s: dict) -> str:
    """One source's line of the report: path, rows read, kept, skipped, and the skip reasons with their counts."""
    if s["rows_read"] == 0:
        return f"{s['path']}: 0 rows read (empty file or split)"
    reasons = ", ".join(f"{n} x {r}" for r, n in sorted(s["skipped_by_reason"].items(), key=lambda x: -x[1]))
    return (f"{s['path']}: {s['rows_read']} rows read, {s['rows_kept']} kept, {s['rows_skipped']} skipped"
            + (f" ({reasons})" if reasons else ""))


def _skip_kept_row(stats: dict, skips: SkipCounter, rec: SkipRecord, counted: bool = False) -> None:
    """A row load_source counted as kept is not written after all (duplicate, contaminated, near-duplicate, left
    out by the mix, over max_samples); ``counted``: its skip record is in ``skips`` already."""
    stats["rows_kept"] -= 1
    stats["rows_skipped"] += 1
    stats["skipped_by_reason"][rec.reason] = stats["skipped_by_reason"].get(rec.reason, 0) + 1
    if not counted:
        skips.add(rec)


def _merge(into: SkipCounter, other: SkipCounter) -> None:
    for reason, n in other.counts.items():
        into.counts[reason] = into.counts.get(reason, 0) + n
        ex = into.examples.setdefault(reason, [])
        ex.extend(other.examples.get(reason, [])[: max(0, into.keep - len(ex))])


def _token_lengths(tok, convs: list[Conversation], chunk: int = 512) -> list[int]:
    """Tokens per conversation: the sum over its turns' texts (content, and reasoning where a turn carries it) of
    ``len(tok(text, add_special_tokens=False))``."""
    per_conv = [[t for m in c.messages for t in (m.content, m.reasoning_content) if t is not None] for c in convs]
    texts = [t for ts in per_conv for t in ts]
    per_text: list[int] = []
    for i in range(0, len(texts), chunk):
        per_text += [len(ids) for ids in tok(texts[i: i + chunk], add_special_tokens=False)["input_ids"]]
    out, j = [], 0
    for ts in per_conv:
        out.append(sum(per_text[j: j + len(ts)]))
        j += len(ts)
    return out


def _summary(v: list[int]) -> dict:
    """count, total, min, mean, p50/p90/p99 (nearest rank) and max of token lengths."""
    if not v:
        return {"count": 0, "total": 0}
    s = sorted(v)

    def pct(p: float) -> int:
        return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]

    return {"count": len(s), "total": sum(s), "min": s[0], "mean": round(sum(s) / len(s), 1), "p50": pct(50),
            "p90": pct(90), "p99": pct(99), "max": s[-1]}


def _plot_histogram(lengths: dict[str, list[int]], path, tokenizer: str, ctx: RunContext) -> bool:
    """One step histogram per source on log-spaced bins, saved as PNG; False (with a warning) without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        ctx.log("[eyas] prepare: matplotlib is not installed (pip install 'eyas[report]'): no token-length PNG")
        return False
    import numpy as np

    values = [n for v in lengths.values() for n in v]
    if not values:
        return False
    hi = max(2, max(values))
    bins = np.unique(np.geomspace(1, hi + 1, 40).astype(int))
    fig = Figure(figsize=(8, 4.5), dpi=110)
    ax = fig.add_subplot()
    for name, v in lengths.items():
        if v:
            ax.hist(v, bins=bins, histtype="step", linewidth=1.4, label=f"{name.rsplit('/', 1)[-1]} ({len(v)})")
    ax.set_xscale("log")
    ax.set_xlabel("tokens per conversation (turn texts, chat template excluded)")
    ax.set_ylabel("conversations")
    ax.set_title(f"prepare: token lengths ({tokenizer.rsplit('/', 1)[-1]} tokenizer)", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return True
