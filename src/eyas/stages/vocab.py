"""vocab: the draft vocabulary and its maps, made once per run and never recomputed (SpecForge issue 300).

The ``vocab.draft_vocab_size`` most frequent target tokens among the assistant tokens of the tokenized data
(:mod:`eyas.data.vocab`). Unset, the size is 32,000, or the target's whole vocabulary when that is smaller (a
full-vocabulary draft: its export carries no d2t, since vLLM has no parameter for one then); a size above the
target's vocabulary is refused when the run starts (:func:`eyas.families.check_run_servable`). With
``vocab.coverage`` the size is the smallest multiple of 64 whose most frequent ids cover that share of the assistant
tokens (at most the size above), measured on this run's data. A dataset without assistant tokens stops the stage.
Writes ``vocab/vocab.safetensors`` (``d2t`` int64 offsets, ``t2d`` bool mask, as SGLang and vLLM read them) and
``vocab/vocab.json`` with the coverage of assistant tokens, also at common sizes.
"""

from __future__ import annotations

from ..data.vocab import (build_draft_vocab, count_tokens, coverage_curve, maps_from_ids, size_for_coverage,
                          write_vocab)
from ..errors import DataError
from ..families import text_config
from ..io import write_json_atomic
from ..records import read_tokenized
from ..summaries import VocabSummary
from ..targets.load import read_target_config
from . import RunContext

READS = ("vocab", "target")
INPUTS = ("tokenize",)


def run(ctx: RunContext) -> VocabSummary:
    cfg = ctx.cfg.vocab
    target_vocab = int(text_config(read_target_config(ctx.cfg.target))["vocab_size"])
    samples = read_tokenized(ctx.run.tokenized)
    a_counts, o_counts = count_tokens(samples)
    if not a_counts:
        # A vocabulary of filler ids would train a drafter on nothing; stop here, where the cause is visible.
        raise DataError(f"vocab: the tokenized dataset ({len(samples)} samples in {ctx.run.tokenized}) has no "
                        f"assistant (trained) token; rerun tokenize with --force")
    size = cfg.size_for(target_vocab)
    if cfg.coverage is not None:
        cap = size
        size = size_for_coverage(a_counts, cfg.coverage, min(cap, target_vocab))
        ctx.log(f"[eyas] vocab: {size} draft ids cover {cfg.coverage:.2%} of the assistant tokens "
                f"(vocab.coverage; at most {cap})")
    ids = build_draft_vocab(a_counts, o_counts, target_vocab, size)
    d2t, t2d = maps_from_ids(ids, target_vocab)
    write_vocab(ctx.run.vocab, d2t, t2d)
    total = sum(a_counts.values())
    covered = sum(c for t, c in a_counts.items() if t2d[t])
    info = VocabSummary(
        draft_vocab_size=len(ids), target_vocab_size=target_vocab,
        distinct_assistant_tokens=len(a_counts), assistant_tokens=total,
        assistant_token_coverage=round(covered / max(total, 1), 6),
        coverage_by_size={str(n): round(c, 6) for n, c in coverage_curve(
            a_counts, [1024, 2048, 4096, 8192, 12288, 16384, 24576, 32000, 65536]).items()},
    )
    if len(a_counts) < size:
        ctx.log(f"[eyas] vocab: only {len(a_counts)} distinct assistant tokens; the rest of the "
                f"{size} draft ids is filled from other tokens")
    write_json_atomic(ctx.run.vocab_info, info.to_json())
    return info
