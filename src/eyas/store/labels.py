"""Compact soft labels (``extract.labels: topk``): the target's next-token distribution over the draft vocabulary,
kept as its ``k`` most probable draft ids, in place of the post-norm last hidden state.

Training's soft label at position s is ``softmax(lm_head(last[s])[draft_ids])`` (the target's logits restricted to
the draft vocabulary and renormalised, SpecForge's ``target_p``; :func:`eyas.train.loss.target_labels`), and a
position counts only when the target's argmax over its whole vocabulary is a draft id. Storing that distribution
instead of ``last`` (H values a token) needs, per token:

- ``label_ids``   int16 [T, k] (int32 when the draft vocabulary has more than 32,767 ids): the k most probable draft
  ids, most probable first;
- ``label_probs`` float16 [T, k]: their probabilities (non-increasing; they sum to the mass the top k hold);
- ``label_flags`` uint8 [T]: bit 0 set when the target's argmax over its full vocabulary is in the draft vocabulary.

That is ``4k + 1`` bytes a token against ``2H`` for a bf16 last state: with fp8 aux states a Kimi-K2-shaped store
(H 7,168) takes ``3(H + 4) + 4 + 4k + 1`` bytes a token, 0.38x of bf16's ``8H + 4`` at k = 32 (issue 20).

The rest of the mass, ``r = 1 - sum(label_probs)``, is spread evenly over the other ``Dv - k`` draft ids when the
labels are read back (:func:`dense_labels`), so that each label sums to 1 as the loss's ``lse * sum(p)`` term
requires and the argmax is the stored first id. The target's own tail is not uniform, but it holds ``r`` in all
(about 0.01 at the k a run chooses: :func:`mass_curve` measures it); spreading it evenly keeps the draft from being
pushed to zero on those ids without inventing an order among them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.vocab import draft_to_target_ids

PROB_DTYPE = torch.float16
FLAG_IN_DRAFT = 1          # label_flags bit 0: the target's argmax is a draft id
MASS_CURVE_KS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def label_id_dtype(draft_vocab_size: int) -> torch.dtype:
    """int16 for a draft vocabulary of at most 32,767 ids, else int32."""
    return torch.int16 if draft_vocab_size <= torch.iinfo(torch.int16).max else torch.int32


def label_bytes_per_token(k: int, draft_vocab_size: int) -> int:
    """Bytes a token of top-k labels: ``k`` ids, ``k`` fp16 probabilities, one flag byte."""
    return k * (label_id_dtype(draft_vocab_size).itemsize + PROB_DTYPE.itemsize) + 1


@dataclass
class CompactLabels:
    """One sample's (or one batch's flattened rows') top-k labels: ``ids`` int16/int32 [N, k], ``probs`` float16
    [N, k], ``flags`` uint8 [N]."""

    ids: torch.Tensor
    probs: torch.Tensor
    flags: torch.Tensor


class LabelMaker:
    """Makes :class:`CompactLabels` from post-norm last hidden states, on ``device``.

    Args:
        lm_head: [V, Ht] the target's lm_head weight (any float dtype; kept on ``device`` in the states' dtype, as
            :func:`eyas.train.loss.target_labels` multiplies).
        d2t: int64 [Dv] and t2d: bool [V]: the run's draft vocabulary (:func:`eyas.data.vocab.load_vocab`).
        k: ids kept a token (at most Dv).
        chunk: rows per product (memory O(chunk x V)).
    Raises:
        ValueError: ``k`` outside 1..Dv.
    """

    def __init__(self, lm_head: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor, k: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16, chunk: int = 4096):
        dv = len(d2t)
        if not 1 <= k <= dv:
            raise ValueError(f"extract.label_topk: {k} is not between 1 and the draft vocabulary's {dv} ids")
        self.device = torch.device(device)
        self.dtype = dtype
        self.k, self.chunk, self.draft_vocab_size = k, chunk, dv
        self.lm_head = lm_head.to(self.device, dtype)
        self.draft_ids = draft_to_target_ids(d2t).to(self.device)
        self.t2d = t2d.to(self.device)
        self.id_dtype = label_id_dtype(dv)
        self.mass_sum = torch.zeros(len(MASS_CURVE_KS), dtype=torch.float32, device=self.device)
        self.rows = 0   # tokens labelled so far (``mass_sum`` is summed over them): :meth:`curve`

    @torch.no_grad()
    def __call__(self, last: torch.Tensor) -> CompactLabels:
        """``last`` [N, Ht] (any device; the store dtype) -> labels of the N rows, on ``last``'s device."""
        out_dev = last.device
        x = last.to(self.device, self.dtype)
        ids, probs, flags = [], [], []
        mass = torch.zeros(len(MASS_CURVE_KS), dtype=torch.float32, device=self.device)
        kmax = min(max(MASS_CURVE_KS), self.draft_vocab_size)
        cols = torch.tensor([min(c, kmax) - 1 for c in MASS_CURVE_KS], device=self.device)
        for a in range(0, x.shape[0], self.chunk):
            logits = x[a: a + self.chunk] @ self.lm_head.T                       # [c, V] in the states' dtype
            flags.append((self.t2d[logits.argmax(-1)].to(torch.uint8) * FLAG_IN_DRAFT))
            p = torch.softmax(logits[:, self.draft_ids].float(), dim=-1)          # [c, Dv]
            top = p.topk(max(self.k, kmax), dim=-1)                               # sorted, most probable first
            mass += top.values.cumsum(-1)[:, cols].sum(0)
            ids.append(top.indices[:, : self.k].to(self.id_dtype))
            probs.append(top.values[:, : self.k].to(PROB_DTYPE))
        self.mass_sum += mass
        self.rows += int(x.shape[0])

        def cat(ts: list, dt: torch.dtype) -> torch.Tensor:
            return torch.cat(ts).to(out_dev) if ts else torch.empty(0, self.k, dtype=dt, device=out_dev)

        return CompactLabels(cat(ids, self.id_dtype), cat(probs, PROB_DTYPE),
                             torch.cat(flags).to(out_dev) if flags else torch.empty(0, dtype=torch.uint8))


    def curve(self) -> dict[int, float]:
        """The mean mass the top 1, 2, 4, ... draft ids held over every token labelled so far (:func:`mass_curve`)."""
        return mass_curve(self.mass_sum.cpu(), self.rows, self.draft_vocab_size)


def mass_curve(mass_sum: torch.Tensor, rows: int, draft_vocab_size: int) -> dict[int, float]:
    """``{k: mean mass the top k hold}`` from :attr:`LabelMaker.mass_sum`, the mass summed over ``rows`` tokens
    (each k of :data:`MASS_CURVE_KS`, those beyond the draft vocabulary as its size Dv, where the mass is 1)."""
    return {min(k, draft_vocab_size): round(float(m) / max(rows, 1), 5)
            for k, m in zip(MASS_CURVE_KS, mass_sum.tolist())}


def smallest_k(curve: dict[int, float], mass: float) -> int | None:
    """The smallest k of ``curve`` whose mean mass is at least ``mass``; None when none is."""
    return next((k for k, m in sorted(curve.items()) if m >= mass), None)


def dense_labels(ids: torch.Tensor, probs: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """Top-k labels back to full distributions over the draft vocabulary: ``ids`` [..., k] int, ``probs`` [..., k]
    (any float dtype) -> fp32 [..., Dv], the stored probabilities at their ids and the rest of the mass
    ``1 - sum(probs)`` spread evenly over the other ``Dv - k`` ids (zero when ``k == Dv``), so each row sums to 1.
    Rows that are all zero (padding) stay zero."""
    p = probs.float()
    k = p.shape[-1]
    held = p.sum(-1, keepdim=True)
    rest = (1.0 - held).clamp_min(0) / max(draft_vocab_size - k, 1) if draft_vocab_size > k else held * 0
    rest = torch.where(held > 0, rest, torch.zeros_like(rest))                   # padding rows stay empty
    out = rest.expand(*p.shape[:-1], draft_vocab_size).clone()
    return out.scatter_(-1, ids.long(), p)


def check_labels(ids: torch.Tensor, probs: torch.Tensor, flags: torch.Tensor, draft_vocab_size: int) -> str | None:
    """What is wrong with one sample's stored labels (a sentence), or None: ids within the draft vocabulary, every
    probability finite and in [0, 1], each row non-increasing and summing to at most 1 (fp16 rounding allowed),
    flags 0 or 1. Used by the writer before commit and by ``eyas doctor``."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= draft_vocab_size):
        return f"label ids outside the draft vocabulary [0, {draft_vocab_size})"
    p = probs.float()
    if not bool(torch.isfinite(p).all()) or (p.numel() and (float(p.min()) < 0 or float(p.max()) > 1)):
        return "label probabilities not finite or outside [0, 1]"
    if p.shape[-1] > 1 and bool((p[..., 1:] > p[..., :-1]).any()):
        return "label probabilities not sorted (most probable first)"
    if p.numel() and float(p.sum(-1).max()) > 1.01:
        return f"label probabilities sum to {float(p.sum(-1).max()):.4f} > 1"
    if flags.numel() and int(flags.max()) > FLAG_IN_DRAFT:
        return "label flags other than 0 and 1"
    return None
