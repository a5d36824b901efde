"""vocab: the draft vocabulary and its maps, made once per run and never recomputed (SpecForge issue 300).

The ``vocab.draft_vocab_size`` most frequent target tokens among the assistant tokens of the tokenized data
(:mod:`eyas.data.vocab`). Writes ``vocab/vocab.safetensors`` (``d2t`` int64 offsets, ``t2d`` bool mask, as SGLang
and vLLM read them) and ``vocab/vocab.json`` with the coverage of assistant tokens.
"""

from __future__ import annotations

from ..data.vocab import build_draft_vocab, count_tokens, maps_from_ids, write_vocab
from ..io import write_json_atomic
from ..records import read_tokenized
from ..summaries import VocabSummary
from ..targets.load import read_target_config
from . import RunContext

READS = ("vocab", "target")
INPUTS = ("tokenize",)


def run(ctx: RunContext) -> VocabSummary:
    cfg = ctx.cfg.vocab
    target_vocab = int(read_target_config(ctx.cfg.target)["vocab_size"])
    a_counts, o_counts = count_tokens(read_tokenized(ctx.run.tokenized))
    ids = build_draft_vocab(a_counts, o_counts, target_vocab, cfg.draft_vocab_size)
    d2t, t2d = maps_from_ids(ids, target_vocab)
    write_vocab(ctx.run.vocab, d2t, t2d)
    total = sum(a_counts.values())
    covered = sum(c for t, c in a_counts.items() if t2d[t])
    info = VocabSummary(
        draft_vocab_size=len(ids), target_vocab_size=target_vocab,
        distinct_assistant_tokens=len(a_counts), assistant_tokens=total,
        assistant_token_coverage=round(covered / max(total, 1), 6),
    )
    if len(a_counts) < cfg.draft_vocab_size:
        ctx.log(f"[eyas] vocab: only {len(a_counts)} distinct assistant tokens; the rest of the "
                f"{cfg.draft_vocab_size} draft ids is filled from other tokens")
    write_json_atomic(ctx.run.vocab_info, info.to_json())
    return info
