"""Training batches from the store (offline): tokenized ids and loss masks joined with stored hidden states.

Every sample's stored ``input_ids`` are checked against the tokenized dataset's before use: a state computed from
other tokens (a stale or foreign store) stops the run with the sample id named.
"""

from __future__ import annotations

import torch

from ..errors import StoreError
from ..records import TokenizedSample
from ..store import HiddenStateStore


class StoreDataset:
    """``ds[i]`` -> dict of ``input_ids`` int64 [T], ``loss_mask`` [T], ``aux`` [T, L*Ht], ``last`` [T, Ht], ``id``.

    Samples longer than ``max_length`` are cut to their first ``max_length`` tokens.
    """

    def __init__(self, samples: list[TokenizedSample], store: HiddenStateStore, max_length: int):
        missing = [s.id for s in samples if s.id not in store]
        if missing:
            raise StoreError(f"{len(missing)} samples have no stored hidden states (first: {missing[0]}); "
                             f"run `eyas extract` (or `eyas doctor --repair`)")
        self.samples, self.store, self.max_length = samples, store, max_length

    def __len__(self) -> int:
        return len(self.samples)

    def num_tokens(self, i: int) -> int:
        return min(self.samples[i].num_tokens, self.max_length)

    def __getitem__(self, i: int) -> dict:
        s = self.samples[i]
        st = self.store.read(s.id)
        ids = torch.tensor(s.input_ids, dtype=torch.int64)
        if st.input_ids.shape != ids.shape or not torch.equal(st.input_ids.long(), ids):
            raise StoreError(f"sample {s.id}: stored input_ids differ from the tokenized dataset "
                             f"(stale or foreign hidden states); run `eyas doctor RUN --repair`")
        n = min(len(ids), self.max_length)
        T, L, H = st.aux.shape
        return {"id": s.id, "input_ids": ids[:n], "loss_mask": torch.tensor(s.loss_mask[:n], dtype=torch.int64),
                "aux": st.aux[:n].reshape(n, L * H), "last": st.last[:n]}


def collate(items: list[dict]) -> dict:
    """Right-pad a list of samples to the longest: ``input_ids`` [B, T], ``loss_mask`` [B, T] (0 on padding),
    ``aux`` [B, T, L*Ht], ``last`` [B, T, Ht], ``ids`` list[str]."""
    T = max(len(x["input_ids"]) for x in items)
    B = len(items)
    out = {
        "input_ids": torch.zeros(B, T, dtype=torch.int64),
        "loss_mask": torch.zeros(B, T, dtype=torch.int64),
        "aux": torch.zeros(B, T, items[0]["aux"].shape[-1], dtype=items[0]["aux"].dtype),
        "last": torch.zeros(B, T, items[0]["last"].shape[-1], dtype=items[0]["last"].dtype),
        "ids": [x["id"] for x in items],
    }
    for b, x in enumerate(items):
        n = len(x["input_ids"])
        for k in ("input_ids", "loss_mask", "aux", "last"):
            out[k][b, :n] = x[k]
    return out


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The deterministic sample order of one epoch (a function of seed and epoch only, so resume is exact)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def micro_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    order = epoch_order(n, seed, epoch)
    return [order[i: i + batch_size] for i in range(0, n, batch_size)]
