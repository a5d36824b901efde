"""Training-time-test (TTT) attention: the mask of every step, and the kernels that compute it (a small registry).

Shape legend: B batch, nh query heads, nkv key/value heads, T tokens, hd head dim, k the TTT step (0-based),
P = T rounded up to a multiple of :data:`FLEX_BLOCK` (flex layout only).

The mask (EAGLE-3, arXiv 2503.01840 section 3.2 "training-time test"; SpecForge ``specforge/core/eagle3.py``):
at step k the query at position t sees the step-0 keys at positions <= t (the causal prefix the target's features
made) and its own keys of steps 1..k at position t (one diagonal per step), exactly the keys the chain anchored at t
has when it drafts its (k+1)-th token at inference. Laid out over the concatenated keys ``[K_0 | K_1 | ... | K_k]``
(each T long) the step-k mask is ``[tril(T) | I_T | ... | I_T]`` of shape [T, (k+1)T]; :func:`ttt_mask` writes it.

Backends (``ATTENTION``; every entry has the same signature and computes the same function):
    sdpa   ``F.scaled_dot_product_attention``: step 0 with ``is_causal``, steps >= 1 over the concatenated keys
           with the dense boolean mask. Exact and portable; the mask is [T, (k+1)T] bools, so use it up to a few
           thousand tokens.
    flex   ``torch.nn.attention.flex_attention`` with a block-sparse mask built directly from block indices
           (never a dense [T, (k+1)T] tensor): the causal prefix costs T^2/2 and each diagonal one 128-wide block
           per query block. Compiled on CUDA; eager (an unfused reference computation) elsewhere. Use it for long
           sequences (8K, 32K).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

FLEX_BLOCK = 128

# fn(q [B, nh, T, hd], ks: k+1 tensors [B, nkv, T, hd] (steps 0..k), vs: same, num_steps: K of this forward)
#   -> [B, nh, T, hd]
AttentionFn = Callable[[torch.Tensor, list, list, int], torch.Tensor]


def ttt_mask(T: int, step: int, device=None) -> torch.Tensor:
    """bool [T, (step+1)*T]: the step-``step`` TTT mask over the concatenated keys ``[K_0 | ... | K_step]``."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)


def sdpa_ttt(q: torch.Tensor, ks: list, vs: list, num_steps: int = 0) -> torch.Tensor:
    """TTT attention with SDPA. q [B, nh, T, hd]; ks/vs k+1 tensors [B, nkv, T, hd] (steps 0..k); returns
    [B, nh, T, hd]. ``num_steps`` is unused (the flex kernel needs it)."""
    rep = q.shape[1] // ks[0].shape[1]
    if len(ks) == 1:
        return F.scaled_dot_product_attention(q, ks[0], vs[0], is_causal=True, enable_gqa=rep > 1)
    T = q.shape[2]
    k = torch.cat(ks, dim=2)                                            # [B, nkv, (s+1)T, hd]
    v = torch.cat(vs, dim=2)
    if rep > 1:  # the masked kernels do not all take enable_gqa: repeat the key/value heads explicitly
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=ttt_mask(T, len(ks) - 1, q.device))


def _flex_mask_mod(P: int, current: torch.Tensor):
    """The TTT mask over slots of P keys; ``current`` (an int tensor, so every step shares one compiled kernel)
    is the step whose queries attend: slots after it are masked out."""
    def mask_mod(b, h, q_idx, kv_idx):
        step, pos = kv_idx // P, kv_idx % P
        return ((step == 0) & (pos <= q_idx)) | ((step > 0) & (step <= current) & (pos == q_idx))
    return mask_mod


@functools.lru_cache(maxsize=64)
def flex_block_mask(T: int, step: int, num_steps: int, device: str):
    """The step-``step`` TTT mask as a flex ``BlockMask`` over Q_LEN = P and KV_LEN = num_steps * P (a fixed key
    layout for every step, so one compiled kernel serves all K steps; the key slots of steps > ``step`` are
    listed in no block and never read). Built from block indices in O(number of blocks), never as a dense mask:
    query block i has full key blocks 0..i-1 and partial blocks i (the causal diagonal of step 0) and s*nb + i
    for s in 1..step (the identity diagonals)."""
    from torch.nn.attention.flex_attention import BlockMask

    nb = -(-T // FLEX_BLOCK)
    P = nb * FLEX_BLOCK
    dev = torch.device(device)
    width = nb * num_steps
    qb = torch.arange(nb, device=dev, dtype=torch.int32)
    kv_num = torch.full((1, 1, nb), step + 1, dtype=torch.int32, device=dev)
    kv_idx = torch.zeros(1, 1, nb, width, dtype=torch.int32, device=dev)
    kv_idx[0, 0, :, : step + 1] = torch.stack([qb + s * nb for s in range(step + 1)], dim=1)
    full_num = qb.view(1, 1, nb).clone()                                             # blocks 0..i-1 are full
    full_idx = torch.zeros(1, 1, nb, width, dtype=torch.int32, device=dev)
    full_idx[0, 0, :, :nb] = torch.arange(nb, dtype=torch.int32, device=dev)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=_flex_mask_mod(P, torch.tensor(step, device=dev)),
                                    seq_lengths=(P, num_steps * P))


@functools.lru_cache(maxsize=1)
def _flex_kernel(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if compiled else flex_attention


def flex_ttt(q: torch.Tensor, ks: list, vs: list, num_steps: int = 0) -> torch.Tensor:
    """TTT attention with flex attention; same contract as :func:`sdpa_ttt`. Keys/values of each step sit in a
    slot of P = T rounded up to :data:`FLEX_BLOCK` positions, ``max(num_steps, k+1)`` slots (zeros beyond step k,
    masked out); padded positions >= T are never attended by real queries."""
    B, nh, T, hd = q.shape
    P = -(-T // FLEX_BLOCK) * FLEX_BLOCK
    slots = max(num_steps, len(ks))

    def pad(x):
        return x if P == T else F.pad(x, (0, 0, 0, P - T))

    empty = [ks[0].new_zeros(ks[0].shape[:2] + (P, hd))] * (slots - len(ks))
    k = torch.cat([pad(x) for x in ks] + empty, dim=2)                               # [B, nkv, slots*P, hd]
    v = torch.cat([pad(x) for x in vs] + empty, dim=2)
    mask = flex_block_mask(T, len(ks) - 1, slots, str(q.device))
    kernel = _flex_kernel(q.device.type == "cuda")
    o = kernel(pad(q), k, v, block_mask=mask, enable_gqa=nh != ks[0].shape[1])
    return o[:, :, :T]


def flex_available() -> bool:
    """True when this torch has ``torch.nn.attention.flex_attention``."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


ATTENTION: dict[str, AttentionFn] = {"sdpa": sdpa_ttt, "flex": flex_ttt}
