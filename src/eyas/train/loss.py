"""The EAGLE-3 training loss, beside the loop (not in the model).

Alignment (positions of one sequence, T tokens): the target's distribution at position s is over token s+1
(``softmax(lm_head(last[s]))``). Step k of TTT at draft position t predicts token t+2+k, so its soft label is
the target distribution at s = t+1+k, restricted to the draft vocabulary and renormalised (SpecForge). A position
counts when the predicted token is an assistant token (``loss_mask[s+1]``) and the target's argmax at s is in the
draft vocabulary (SpecForge leaves the others out). Step k is weighted ``decay**k``; each step's loss is the mean
over its counted positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class TargetLabels:
    """Soft labels per source position s: ``probs`` fp32 [B, T, Dv] over token s+1, ``valid`` bool [B, T]."""

    probs: torch.Tensor
    valid: torch.Tensor


@torch.no_grad()
def target_labels(last: torch.Tensor, lm_head: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor,
                  loss_mask: torch.Tensor, chunk: int = 1024) -> TargetLabels:
    """Soft labels from the stored post-norm last hidden state.

    Args:
        last: [B, T, Ht] post-norm last hidden state of the target.
        lm_head: [V, Ht] the target's lm_head weight.
        draft_ids: int64 [Dv] target ids of the draft vocabulary (ascending).
        t2d: bool [V].
        loss_mask: [B, T] 1 on assistant tokens (0 on padding).
    """
    B, T, _ = last.shape
    probs = torch.empty(B, T, len(draft_ids), dtype=torch.float32, device=last.device)
    in_draft = torch.empty(B, T, dtype=torch.bool, device=last.device)
    w = lm_head.to(last.dtype)
    for a in range(0, T, chunk):
        logits = (last[:, a: a + chunk] @ w.T).float()                      # [B, c, V]
        in_draft[:, a: a + chunk] = t2d[logits.argmax(-1)]
        probs[:, a: a + chunk] = torch.softmax(logits[..., draft_ids], dim=-1)
    next_is_assistant = torch.zeros_like(in_draft)
    next_is_assistant[:, :-1] = loss_mask[:, 1:].bool()
    return TargetLabels(probs=probs, valid=in_draft & next_is_assistant)


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, t] <- x[:, t+n] along dim 1, zero-filled at the end."""
    if n == 0:
        return x
    out = torch.zeros_like(x)
    out[:, : x.shape[1] - n] = x[:, n:]
    return out


def ttt_loss(step_logits: list[torch.Tensor], labels: TargetLabels, decay: float) -> tuple[torch.Tensor, dict]:
    """Weighted soft-label cross-entropy over TTT steps.

    Args:
        step_logits: K tensors [B, T, Dv]: draft logits of step k at position t (predicting token t+2+k).
        labels: from :func:`target_labels`.
        decay: step k is weighted decay**k.
    Returns:
        (loss scalar, metrics dict with per-step ``loss_k``, ``acc_k`` (argmax agreement) and ``count_k``).
    """
    total = step_logits[0].new_zeros((), dtype=torch.float32)
    metrics: dict = {}
    for k, logits in enumerate(step_logits):
        p = _shift(labels.probs, 1 + k)                                         # [B, T, Dv]
        m = _shift(labels.valid, 1 + k).float()                                 # [B, T]
        logp = F.log_softmax(logits.float(), dim=-1)
        ce = -(p * logp).sum(-1)                                                # [B, T]
        n = m.sum()
        loss_k = (ce * m).sum() / n.clamp(min=1)
        total = total + (decay ** k) * loss_k
        with torch.no_grad():
            hit = (logits.argmax(-1) == p.argmax(-1)).float()
            metrics[f"loss_{k}"] = float(loss_k)
            metrics[f"acc_{k}"] = float((hit * m).sum() / n.clamp(min=1))
            metrics[f"count_{k}"] = int(n)
    return total, metrics
