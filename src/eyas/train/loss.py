"""The EAGLE-3 training loss, beside the loop (not in the model).

Alignment (positions of one sequence, T tokens): the target's distribution at position s is over token s+1
(``softmax(lm_head(last[s]))``). Step k of TTT at draft position t predicts token t+2+k, so its soft label is
the target distribution at s = t+1+k, restricted to the draft vocabulary and renormalised (SpecForge). A position
counts when the predicted token is an assistant token (``loss_mask[s+1]``) and the target's argmax at s is in the
draft vocabulary (SpecForge leaves the others out). Step k is weighted ``decay**k``; each step's loss is the mean
over its counted positions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .fp8 import MULTIPLE as FP8_MULTIPLE   # torch._scaled_mm: every dimension of an fp8 operand a multiple of 16


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
        logits = last[:, a: a + chunk] @ w.T                                # [B, c, V] in the states' dtype
        in_draft[:, a: a + chunk] = t2d[logits.argmax(-1)]                  # no fp32 copy of the full vocabulary
        probs[:, a: a + chunk] = torch.softmax(logits[..., draft_ids].float(), dim=-1)
    next_is_assistant = torch.zeros_like(in_draft)
    next_is_assistant[:, :-1] = loss_mask[:, 1:].bool()
    return TargetLabels(probs=probs, valid=in_draft & next_is_assistant)


def stored_labels(label_ids: torch.Tensor, label_probs: torch.Tensor, label_flags: torch.Tensor,
                  draft_vocab_size: int, loss_mask: torch.Tensor) -> TargetLabels:
    """Soft labels from a top-k store (``extract.labels: topk``, :mod:`eyas.store.labels`): the same
    :class:`TargetLabels` :func:`target_labels` makes from the last hidden state, up to the stored top k.

    Args:
        label_ids: int16/int32 [B, T, k] draft ids, most probable first; label_probs: [B, T, k] their
            probabilities; label_flags: uint8 [B, T], bit 0 set where the target's argmax is a draft id.
        draft_vocab_size: Dv.
        loss_mask: [B, T] 1 on assistant tokens (0 on padding).
    Returns probs fp32 [B, T, Dv]: the stored probabilities, the rest of the mass spread evenly over the other ids
    (:func:`eyas.store.labels.dense_labels`); valid as :func:`target_labels` defines it.
    """
    from ..store.labels import FLAG_IN_DRAFT, dense_labels

    probs = dense_labels(label_ids, label_probs, draft_vocab_size)
    next_is_assistant = torch.zeros_like(loss_mask, dtype=torch.bool)
    next_is_assistant[:, :-1] = loss_mask[:, 1:].bool()
    in_draft = (label_flags & FLAG_IN_DRAFT).bool()
    return TargetLabels(probs=probs, valid=in_draft & next_is_assistant)


def batch_labels(batch: dict, lm_head: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor,
                 dtype: torch.dtype | None = None) -> TargetLabels:
    """A device batch's soft labels: from its stored top-k labels when it has them (:func:`stored_labels`), else
    from its last hidden state through the target's lm_head (:func:`target_labels`, ``last`` cast to ``dtype``
    when given)."""
    if "label_probs" in batch:
        return stored_labels(batch["label_ids"], batch["label_probs"], batch["label_flags"], len(draft_ids),
                             batch["loss_mask"])
    last = batch["last"] if dtype is None else batch["last"].to(dtype)
    return target_labels(last, lm_head, draft_ids, t2d, batch["loss_mask"])


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
        logp = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
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


def _soft_ce_chunk(logits: torch.Tensor, probs: torch.Tensor, row_w: torch.Tensor, grad_row_w: torch.Tensor):
    """logits fp32 [B, c, Dv], probs fp32 [B, c, Dv], row_w and grad_row_w [B, c] -> (sum_r w_r CE_r, weighted
    argmax hits, the gradient of sum_r grad_row_w_r CE_r as fp32 [B, c, Dv]). CE against soft labels p:
    lse * sum(p) - sum(p * x)."""
    rw = row_w.to(logits.dtype)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)                         # [B, c, 1]
    psum = probs.sum(-1, keepdim=True)
    loss = (rw * (lse.squeeze(-1) * psum.squeeze(-1) - (probs * logits).sum(-1))).sum()
    hits = (rw.ne(0) & (logits.argmax(-1) == probs.argmax(-1))).float().sum()
    grad = (torch.exp(logits - lse) * psum - probs) * grad_row_w.to(logits.dtype).unsqueeze(-1)
    return loss, hits, grad


@functools.lru_cache(maxsize=2)
def _soft_ce_kernel(compiled: bool):
    return torch.compile(_soft_ce_chunk, dynamic=True) if compiled else _soft_ce_chunk


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _soft_ce_chunk_fp8(logits: torch.Tensor, probs: torch.Tensor, row_w: torch.Tensor, grad_row_w: torch.Tensor,
                       g_scale: torch.Tensor):
    """:func:`_soft_ce_chunk` with the gradient returned in fp8 e5m2, multiplied by ``g_scale`` (fp32, 0-dim) before
    the cast, in the same pass (no fp32 [B, c, Dv] gradient is written)."""
    loss, hits, grad = _soft_ce_chunk(logits, probs, row_w, grad_row_w)
    g = (grad * g_scale).clamp(-torch.finfo(E5M2).max, torch.finfo(E5M2).max)
    return loss, hits, g.to(E5M2)


@functools.lru_cache(maxsize=2)
def _soft_ce_kernel_fp8(compiled: bool):
    return torch.compile(_soft_ce_chunk_fp8, dynamic=True) if compiled else _soft_ce_chunk_fp8


def _to_e4m3(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensorwise fp8 e4m3: (``t * s`` cast to e4m3, ``1 / s``) with ``s = 448 / amax(|t|)``; the second is the
    scale ``torch._scaled_mm`` multiplies the product back by."""
    fmax = torch.finfo(E4M3).max
    s = fmax / t.detach().abs().amax().float().clamp(min=1e-12)
    return (t.float() * s).clamp(-fmax, fmax).to(E4M3), s.reciprocal()


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same [m, n] matrix laid out column by column (``torch._scaled_mm``'s second operand)."""
    return t.t().contiguous().t()


def _chunk_products(weight: torch.Tensor, cd: torch.dtype, acc: torch.dtype, compiled: bool, need_grad: bool):
    """One chunk's work in the compute dtype ``cd`` (bf16 under autocast): ``f(xc [B, c, H], probs [B, c, Dv],
    row_w [B, c], grad_rows [B, c]) -> (loss, hits, g W [B, c, H] or None, g^T x [Dv, H] in ``acc`` or None)``."""
    w_c = weight.to(cd)
    kernel = _soft_ce_kernel(compiled)

    def products(xc, probs, row_w, grad_rows):
        xc = xc.to(cd)
        logits = (xc @ w_c.T).to(acc)                                           # [B, c, Dv]
        loss, hits, g = kernel(logits, probs, row_w, grad_rows)
        if not need_grad:
            return loss, hits, None, None
        g = g.to(cd)
        return loss, hits, g @ w_c, (g.flatten(0, 1).T @ xc.flatten(0, 1)).to(acc)
    return products


def _chunk_products_fp8(weight: torch.Tensor, acc: torch.dtype, compiled: bool, need_grad: bool):
    """:func:`_chunk_products` with the three products in fp8 (see :class:`_ChunkedSoftCE`); W is cast once."""
    kernel = _soft_ce_kernel_fp8(compiled)
    Dv, H = weight.shape
    w8, w_inv = _to_e4m3(weight)                          # [Dv, H] row-major: w8.t() is [H, Dv] column-major
    w8_cm = _col_major(w8) if need_grad else None         # [Dv, H] column-major, for g @ W
    g_fmax = torch.finfo(E5M2).max

    def products(xc, probs, row_w, grad_rows):
        B, c, _ = xc.shape
        cp = -(-c // FP8_MULTIPLE) * FP8_MULTIPLE                               # c padded to a multiple of 16
        if cp != c:
            xc = F.pad(xc, (0, 0, 0, cp - c))
        x8, x_inv = _to_e4m3(xc.reshape(B * cp, H))                             # [B*cp, H] row-major
        logits = torch._scaled_mm(x8, w8.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=torch.bfloat16)
        logits = logits.view(B, cp, Dv)[:, :c].to(acc)                          # [B, c, Dv]
        g_scale = g_fmax / grad_rows.abs().amax().float().clamp(min=1e-30)      # |g| <= max row weight
        loss, hits, g8 = kernel(logits, probs, row_w, grad_rows, g_scale)
        if not need_grad:
            return loss, hits, None, None
        if cp != c:
            padded = torch.zeros(B, cp, Dv, dtype=E5M2, device=g8.device)
            padded[:, :c] = g8
            g8 = padded
        g8 = g8.reshape(B * cp, Dv)
        g_inv = g_scale.reciprocal()
        gx = torch._scaled_mm(g8, w8_cm, scale_a=g_inv, scale_b=w_inv, out_dtype=torch.bfloat16)
        gw = torch._scaled_mm(g8.t().contiguous(), _col_major(x8), scale_a=g_inv, scale_b=x_inv,
                              out_dtype=torch.float32)
        return loss, hits, gx.view(B, cp, H)[:, :c], gw
    return products


class _ChunkedSoftCE(torch.autograd.Function):
    """All K TTT steps' ``sum_k w_k sum_rows rw_k[r] CE(p_k[r], softmax(x_k[r] @ W^T))`` in one autograd node,
    without keeping logits: the gradients are computed in the forward pass chunk by chunk (the fused linear +
    cross-entropy technique), so memory is O(chunk x Dv), never [T, Dv] per step, and the lm_head gradient is one
    buffer [Dv, H] (fp32) accumulated over every chunk of every step (one node per step would keep K of them until
    backward: 3.7 GB for a Llama-3.1-8B-shaped draft at TTT 7). Also returns the per-step unweighted losses and
    weighted argmax agreements (no gradient).

    ``tensors`` holds K inputs x [B, n_k, H], then K label views [B, n_k, Dv], then K row weights [B, n_k].

    ``fp8``: the three products of each chunk (logits ``x W^T``, ``g W`` and ``g^T x`` for the gradients) in fp8
    through ``torch._scaled_mm``, one scale per tensor: ``x`` and ``W`` in e4m3 (amax scaling), the logits'
    gradient ``g`` in e5m2 scaled by its bound (``|g| <= max row weight``, as softmax and the labels lie in [0, 1]),
    the products accumulated in fp32 (logits and ``g W`` returned in bf16, ``g^T x`` in fp32). Positions are padded
    with zeros to a multiple of 16 per chunk (zero rows carry zero gradient). torchao's tensorwise recipe for the
    linear layers works the same way (``eyas.train.fp8``)."""

    @staticmethod
    def forward(ctx, weight, step_weights: tuple, chunk: int, compute_dtype, compiled: bool, need_grad: bool,
                fp8: bool, *tensors):
        K = len(step_weights)
        xs, probs_k, rows_k = tensors[:K], tensors[K: 2 * K], tensors[2 * K:]
        acc = torch.promote_types(weight.dtype, torch.float32)     # fp32 accumulation (fp64 in exactness tests)
        products = (_chunk_products_fp8(weight, acc, compiled, need_grad) if fp8
                    else _chunk_products(weight, compute_dtype, acc, compiled, need_grad))
        device = weight.device
        grad_w = torch.zeros(weight.shape, dtype=acc, device=device) if need_grad else None
        losses = torch.zeros(K, dtype=acc, device=device)
        hits = torch.zeros(K, dtype=torch.float32, device=device)
        total = torch.zeros((), dtype=acc, device=device)
        grad_xs = []
        for k, (x, probs, row_w, w_k) in enumerate(zip(xs, probs_k, rows_k, step_weights)):
            B, T, H = x.shape
            grad_rows = row_w * w_k                   # the step's weight, on the device (no host copy in the step)
            grad_x = torch.empty(B, T, H, dtype=x.dtype, device=device) if need_grad else None
            loss_k = torch.zeros((), dtype=acc, device=device)
            for a in range(0, T, chunk):
                loss_c, hits_c, gx, gw = products(x[:, a: a + chunk], probs[:, a: a + chunk],
                                                  row_w[:, a: a + chunk], grad_rows[:, a: a + chunk])
                loss_k = loss_k + loss_c
                hits[k] += hits_c
                if need_grad:
                    grad_x[:, a: a + chunk] = gx.to(x.dtype)
                    grad_w += gw
            losses[k] = loss_k
            total = total + w_k * loss_k
            grad_xs.append(grad_x)
        if need_grad:
            ctx.save_for_backward(grad_w, *grad_xs)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(losses, hits)
        return total, losses, hits

    @staticmethod
    def backward(ctx, grad_total, _grad_losses, _grad_hits):
        grad_w, *grad_xs = ctx.saved_tensors
        return ((grad_w * grad_total).to(ctx.weight_dtype),) + (None,) * 6 + tuple(
            g * grad_total.to(g.dtype) for g in grad_xs) + (None,) * (2 * len(grad_xs))


def ttt_loss_fused(step_hidden: list[torch.Tensor], norm: torch.nn.Module, lm_head_weight: torch.Tensor,
                   labels: TargetLabels, decay: float, chunk: int = 2048, compiled: bool = False,
                   denominators: torch.Tensor | None = None, fp8: bool = False) -> tuple[torch.Tensor, dict]:
    """The same loss as :func:`ttt_loss`, computed from the pre-norm hidden states with the draft lm_head fused
    into the cross-entropy (no [T, Dv] logits kept for backward; chunks of ``chunk`` positions), all TTT steps in
    one autograd node with one lm_head gradient buffer.

    Args:
        step_hidden: K tensors [B, T, H]: step k's pre-norm hidden (the draft model's ``forward``).
        norm: the draft's final RMSNorm (applied here, inside autograd).
        lm_head_weight: [Dv, H] the draft lm_head weight.
        labels: from :func:`target_labels`; step k at position t uses the labels of s = t+1+k (a view, no copy).
        decay: step k is weighted decay**k.
        chunk: positions per chunk (memory O(chunk x Dv)).
        compiled: run the per-chunk elementwise work through ``torch.compile`` (one fused kernel; GPU).
        denominators: [K] the counted positions per step to divide by (default: this batch's,
            :func:`step_counts`); the distributed loop passes the counts of the global batch, all processes summed.
        fp8: the lm_head's products in fp8, one scale per tensor (``train.fp8_lm_head``; see
            :class:`_ChunkedSoftCE`); needs ``torch._scaled_mm`` for fp8 on the device (a CUDA GPU of compute
            capability >= 8.9, or the CPU) and a hidden size and draft vocabulary that are multiples of 16.
    Returns:
        (loss scalar fp32, metrics dict with ``loss_k``, ``acc_k``, ``count_k`` as :func:`ttt_loss`, plus
        ``hits_k``, the count of argmax agreements). The metric values stay tensors on the device (no host sync
        inside the step); the loop moves them to the host once per optimizer step.
    """
    cd = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else (
        torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else lm_head_weight.dtype)
    T = labels.probs.shape[1]
    acc = torch.promote_types(labels.probs.dtype, torch.float32)
    steps, xs, probs, rows, weights, counts, dens = [], [], [], [], [], [], []
    for k, h in enumerate(step_hidden):
        n_rows = T - 1 - k                                   # positions whose label s = t+1+k exists
        if n_rows <= 0:
            continue
        valid = labels.valid[:, 1 + k:].to(acc)                                 # [B, n_rows]
        count = valid.sum()
        n = (count if denominators is None else denominators[k].to(acc)).clamp(min=1)
        steps.append(k)
        xs.append(norm(h[:, :n_rows]))                                          # [B, n_rows, H]
        probs.append(labels.probs[:, 1 + k:])
        rows.append(valid / n)
        weights.append(decay ** k)
        counts.append(count)
        dens.append(n)
    metrics: dict = {}
    if not steps:
        return torch.zeros((), dtype=acc, device=labels.probs.device), metrics
    need_grad = torch.is_grad_enabled() and (any(x.requires_grad for x in xs) or lm_head_weight.requires_grad)
    if fp8 and any(d % FP8_MULTIPLE for d in lm_head_weight.shape):
        raise ValueError(f"fp8 lm_head products need a draft vocabulary and hidden size that are multiples of "
                         f"{FP8_MULTIPLE}; the lm_head is {list(lm_head_weight.shape)}")
    total, losses, hits = _ChunkedSoftCE.apply(lm_head_weight, tuple(weights), chunk, cd, compiled, need_grad,
                                               fp8, *xs, *probs, *rows)
    for i, k in enumerate(steps):
        metrics[f"loss_{k}"] = losses[i]
        metrics[f"acc_{k}"] = hits[i] / dens[i]
        metrics[f"count_{k}"] = counts[i]
        metrics[f"hits_{k}"] = hits[i]
    return total, metrics


def step_counts(labels: TargetLabels, ttt_steps: int) -> torch.Tensor:
    """fp32 [K]: the positions step k counts in this batch (valid labels at s >= 1 + k)."""
    return torch.stack([labels.valid[:, 1 + k:].sum() for k in range(ttt_steps)]).float()
