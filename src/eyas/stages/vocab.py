"""vocab: the draft vocabulary and its maps, made once per run and never recomputed (SpecForge issue 300).

The draft vocabulary is the ``draft_vocab_size`` most frequent target tokens among the assistant (loss-masked)
tokens of the training data, sorted ascending by target id (FIELD_NOTES). When the data has fewer distinct
assistant tokens, the rest is filled with the most frequent other tokens, then the lowest unused ids. Unset, the
size is 32,000, or the target's whole vocabulary when that is smaller (a full-vocabulary draft: its export carries
no d2t, since vLLM has no parameter for one then). A size above the target's vocabulary is refused when the run
starts (:func:`eyas.families.check_run_servable`). A dataset without assistant tokens stops the stage.
With ``vocab.coverage`` the size is the smallest multiple of 64 whose most frequent ids cover that share of the
assistant tokens (at most the size above), measured on this run's data; ``vocab.json`` records the coverage at
common sizes.

Writes ``vocab/vocab.safetensors``:
- ``d2t`` int64 [draft_vocab]: ``d2t[i] = draft_to_target_id[i] - i`` (offsets, as SGLang and vLLM read them);
- ``t2d`` bool [target_vocab]: True for target ids in the draft vocabulary;
and ``vocab/vocab.json`` with the coverage of assistant tokens.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import ConfigError, DataError, StoreError
from ..families import check_run_servable, text_config
from ..io import atomic_path, write_json_atomic
from ..targets.load import read_target_config
from . import RunContext
from .tokenize import load_samples


def build_draft_vocab(assistant_counts: Counter, other_counts: Counter, target_vocab: int, size: int) -> torch.Tensor:
    """Draft-to-target ids, int64 [size], ascending. Raises :class:`ConfigError` when size > target_vocab."""
    if size > target_vocab:
        raise ConfigError(f"vocab.draft_vocab_size={size} exceeds the target vocabulary ({target_vocab})")
    chosen = [t for t, _ in sorted(assistant_counts.items(), key=lambda x: (-x[1], x[0]))[:size]]
    if len(chosen) < size:
        have = set(chosen)
        extra = [t for t, _ in sorted(other_counts.items(), key=lambda x: (-x[1], x[0])) if t not in have]
        chosen += extra[: size - len(chosen)]
        have = set(chosen)
        t = 0
        while len(chosen) < size:
            if t not in have:
                chosen.append(t)
            t += 1
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def coverage_curve(assistant_counts: Counter, sizes: list[int]) -> dict[int, float]:
    """Share of assistant tokens that the ``n`` most frequent ids cover, for each ``n`` in ``sizes``."""
    freq = sorted(assistant_counts.values(), reverse=True)
    total = max(sum(freq), 1)
    out, acc, i = {}, 0, 0
    for n in sorted(sizes):
        while i < min(n, len(freq)):
            acc += freq[i]
            i += 1
        out[n] = acc / total
    return out


def size_for_coverage(assistant_counts: Counter, coverage: float, cap: int, multiple: int = 64) -> int:
    """The smallest draft vocabulary (a multiple of ``multiple``, at most ``cap``) whose most frequent ids cover
    ``coverage`` of the assistant tokens; ``cap`` when none smaller does."""
    freq = sorted(assistant_counts.values(), reverse=True)
    need, acc = coverage * sum(freq), 0
    for n, f in enumerate(freq, 1):
        acc += f
        if acc >= need:
            return min(cap, -(-n // multiple) * multiple)
    return cap


def maps_from_ids(draft_ids: torch.Tensor, target_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t int64 [D], t2d bool [V])`` from ascending draft-to-target ids [D]."""
    d2t = draft_ids - torch.arange(len(draft_ids), dtype=torch.int64)
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def load_vocab(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Read ``(d2t, t2d)`` and check they agree; raises :class:`StoreError` otherwise."""
    t = load_file(str(path))
    d2t, t2d = t["d2t"], t["t2d"]
    ids = d2t + torch.arange(len(d2t))
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool or int(t2d.sum()) != len(d2t) or not bool(t2d[ids].all()):
        raise StoreError(f"{path}: d2t and t2d disagree (corrupt vocabulary file)")
    return d2t, t2d


def run(ctx: RunContext) -> dict:
    cfg = ctx.cfg.vocab
    tcfg = read_target_config(ctx.cfg.target)
    check_run_servable(ctx.cfg, tcfg, ctx.log)
    target_vocab = int(text_config(tcfg)["vocab_size"])
    a_counts, o_counts = Counter(), Counter()
    samples = load_samples(ctx)
    for s in samples:
        for t, m in zip(s.input_ids, s.loss_mask):
            (a_counts if m else o_counts)[t] += 1
    if not a_counts:
        # A vocabulary of filler ids would train a drafter on nothing; stop here, where the cause is visible.
        raise DataError(f"vocab: the tokenized dataset ({len(samples)} samples in "
                        f"{ctx.stage_dir('tokenize') / 'samples.jsonl'}) has no assistant (trained) token; rerun "
                        f"tokenize with --force")
    size = cfg.size_for(target_vocab)
    if cfg.coverage is not None:
        cap = size
        size = size_for_coverage(a_counts, cfg.coverage, min(cap, target_vocab))
        ctx.log(f"[eyas] vocab: {size} draft ids cover {cfg.coverage:.2%} of the assistant tokens "
                f"(vocab.coverage; at most {cap})")
    ids = build_draft_vocab(a_counts, o_counts, target_vocab, size)
    d2t, t2d = maps_from_ids(ids, target_vocab)
    out = ctx.stage_dir("vocab")
    with atomic_path(out / "vocab.safetensors") as tmp:
        save_file({"d2t": d2t, "t2d": t2d}, str(tmp))
    total = sum(a_counts.values())
    covered = sum(c for t, c in a_counts.items() if t2d[t])
    info = {
        "draft_vocab_size": len(ids), "target_vocab_size": target_vocab,
        "distinct_assistant_tokens": len(a_counts), "assistant_tokens": total,
        "assistant_token_coverage": round(covered / max(total, 1), 6),
        "coverage_by_size": {str(n): round(c, 6) for n, c in coverage_curve(
            a_counts, [1024, 2048, 4096, 8192, 12288, 16384, 24576, 32000, 65536]).items()},
    }
    if len(a_counts) < size:
        ctx.log(f"[eyas] vocab: only {len(a_counts)} distinct assistant tokens; the rest of the "
                f"{size} draft ids is filled from other tokens")
    write_json_atomic(out / "vocab.json", info)
    return info
