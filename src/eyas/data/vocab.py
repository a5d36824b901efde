"""The draft vocabulary and its maps, made once per run and never recomputed (SpecForge issue 300).

The draft vocabulary is the ``size`` most frequent target tokens among the assistant (loss-masked) tokens of the
training data, sorted ascending by target id (FIELD_NOTES). When the data has fewer distinct assistant tokens, the
rest is filled with the most frequent other tokens, then the lowest unused ids.

The maps, as SGLang and vLLM read them and as ``vocab.safetensors`` holds them:
- ``d2t`` int64 [draft_vocab]: ``d2t[i] = draft_to_target_id[i] - i`` (offsets);
- ``t2d`` bool [target_vocab]: True for target ids in the draft vocabulary.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import ConfigError, StoreError
from ..io import atomic_path
from ..records import TokenizedSample


def count_tokens(samples: Iterable[TokenizedSample]) -> tuple[Counter, Counter]:
    """``(assistant token counts, other token counts)`` over the samples' ids, split by their loss mask."""
    a_counts, o_counts = Counter(), Counter()
    for s in samples:
        for t, m in zip(s.input_ids, s.loss_mask):
            (a_counts if m else o_counts)[t] += 1
    return a_counts, o_counts


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


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The target id of each draft id, int64 [D] on ``d2t``'s device, from the ``d2t`` offsets (int64 [D]):
    ``d2t[i] + i``, as SGLang and vLLM map a drafted id back to the target's vocabulary."""
    return (d2t + torch.arange(len(d2t), device=d2t.device)).long()


def maps_from_ids(draft_ids: torch.Tensor, target_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t int64 [D], t2d bool [V])`` from ascending draft-to-target ids [D]."""
    d2t = draft_ids - torch.arange(len(draft_ids), dtype=torch.int64)
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def check_maps(d2t: torch.Tensor, t2d: torch.Tensor, where: str) -> None:
    """Raise :class:`StoreError` naming ``where`` unless ``d2t`` (int64 offsets) and ``t2d`` (bool) describe the same
    draft vocabulary."""
    ids = draft_to_target_ids(d2t)
    if (d2t.dtype != torch.int64 or t2d.dtype != torch.bool or int(t2d.sum()) != len(d2t)
            or (len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= len(t2d))) or not bool(t2d[ids].all())):
        raise StoreError(f"{where}: d2t and t2d disagree (corrupt vocabulary)")


def write_vocab(path: Path, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Write ``vocab.safetensors`` atomically."""
    with atomic_path(path) as tmp:
        save_file({"d2t": d2t, "t2d": t2d}, str(tmp))


def load_vocab(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Read ``(d2t, t2d)`` and check they agree; raises :class:`StoreError` otherwise."""
    t = load_file(str(path))
    check_maps(t["d2t"], t["t2d"], str(path))
    return t["d2t"], t["t2d"]


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
