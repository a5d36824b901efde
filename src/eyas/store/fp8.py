"""fp8 (e4m3) storage of aux hidden states with one scale per token and layer.

Each aux row ``x = aux[t, l, :]`` (H values) is stored as ``q = round_e4m3(x / s)`` with ``s = max|x| / 448``
(448 is the largest finite ``float8_e4m3fn``), and read back as ``q * s``. One float32 scale per (token, layer)
costs 4 bytes per row; the aux states then take ``3 * (H + 4)`` bytes per token instead of ``6 * H`` in bf16.
speculators stores fp8 aux states the same way (per-token scaling) and reports acceptance within about 0.05 of
bf16 (FIELD_NOTES, extraction rule 5). The last hidden state is not quantised: it gives the soft labels.

Works on any device; the transformers capture backend quantises on the GPU before the device-to-host copy.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_TINY = 1e-12    # scale floor, so an all-zero row quantises to zeros instead of 0/0


def quantize_fp8(aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``aux`` [..., H] (any float dtype) to ``(q, scale)``: ``q`` float8_e4m3fn [..., H],
    ``scale`` float32 [...] (one per row). Non-finite inputs give non-finite scales (caught by the writer)."""
    x = aux.float()
    scale = (x.abs().amax(dim=-1) / FP8_MAX).clamp_min(_TINY)  # [...]
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: ``q`` float8_e4m3fn [..., H], ``scale`` float32 [...] -> ``dtype`` [..., H]."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def fp8_has_nan(q: torch.Tensor) -> bool:
    """True when an e4m3fn tensor holds a NaN (bit pattern S.1111.111; the format has no infinities)."""
    return bool(((q.view(torch.uint8) & 0x7F) == 0x7F).any())
