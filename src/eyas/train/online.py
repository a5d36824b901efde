"""Online training's state source: the target runs inside the training job and makes each batch's hidden states.

Nothing is stored: for a small or medium target the forward pass costs less than writing and re-reading 8 * H bytes
per token (``eyas plan`` compares the two). The states are the extract stage's own numbers (the same capture
backend, compute dtype and store dtype, fp8 round trip included), so offline and online training see the same
values. With the transformers backend the batch never leaves the device (:meth:`TransformersBackend.capture_padded`);
another backend (vLLM) captures per sample through the host, as extraction does.
"""

from __future__ import annotations

import torch

from ..capture import make_backend
from ..store.fp8 import dequantize_fp8
from ..store.shards import DTYPES as STORE_DTYPES


class OnlineStates:
    """``states(batch, device)`` for :func:`eyas.train.loop.train`: fills ``aux`` [B, T, L*Ht] and ``last``
    [B, T, Ht] (store dtype, zero on padding) for a collated batch whose ``input_ids``/``attention_mask`` are on
    ``device``.

    Args:
        target_cfg, extract_cfg: the run's ``target`` and ``extract`` sections (backend, compute and store dtypes).
        layer_ids: aux layers, ``output_of_layer`` (the store's convention).
        samples: the tokenized samples by id (the host path looks them up).
        device: where the target runs (default ``target.device``).
    """

    def __init__(self, target_cfg, extract_cfg, layer_ids: list[int], samples: list, device: str | None = None):
        self.backend = make_backend(extract_cfg.backend, target_cfg, extract_cfg, layer_ids, device)
        self.by_id = {s.id: s for s in samples}
        self.dtype = STORE_DTYPES[extract_cfg.dtype]

    def __call__(self, batch: dict, device: torch.device) -> dict:
        if hasattr(self.backend, "capture_padded"):
            aux, last = self.backend.capture_padded(batch["input_ids"], batch["attention_mask"])
            B, T, L, H = aux.shape
            return {**batch, "aux": aux.reshape(B, T, L * H).to(device), "last": last.to(device)}
        return self._through_host(batch, device)

    def _through_host(self, batch: dict, device: torch.device) -> dict:
        got = {c.sample_id: c for c in self.backend.capture([self.by_id[i] for i in batch["ids"]])}
        B, T = batch["input_ids"].shape
        aux = last = None
        for r, sid in enumerate(batch["ids"]):
            c = got[sid]
            a = dequantize_fp8(c.aux, c.aux_scale, self.dtype) if c.aux_scale is not None else c.aux   # [T, L, Ht]
            n = int(batch["attention_mask"][r].sum())           # the sample, cut to train.max_length
            if aux is None:
                aux = torch.zeros(B, T, a.shape[1] * a.shape[2], dtype=a.dtype)
                last = torch.zeros(B, T, c.last.shape[-1], dtype=c.last.dtype)
            aux[r, :n] = a[:n].reshape(n, -1)
            last[r, :n] = c.last[:n]
        return {**batch, "aux": aux.to(device), "last": last.to(device)}

    def close(self) -> None:
        self.backend.close()
