"""Training samples: tokenized ids and loss masks, joined offline with the stored hidden states; batching.

Every sample read from the store is re-hashed against the checksum committed with it, and its stored ``input_ids``
are checked against the tokenized dataset's, before use: a changed byte, or a state computed from other tokens (a
stale or foreign store), stops the run with the sample id named.
"""

from __future__ import annotations

import torch

from ..errors import StoreError
from ..records import TokenizedSample
from ..store import HiddenStateStore


STATE_KEYS = ("aux", "last", "label_ids", "label_probs", "label_flags")   # per-token tensors of a stored sample


class SampleDataset:
    """``ds[i]`` -> dict of ``id``, ``input_ids`` int64 [T], ``loss_mask`` int64 [T] and, with a ``store``
    (offline), ``aux`` [T, L*Ht] and ``last`` [T, Ht] in the store dtype, or, from a top-k store, ``label_ids``
    [T, k], ``label_probs`` float16 [T, k] and ``label_flags`` uint8 [T] in place of ``last``
    (:mod:`eyas.store.labels`). Online (no store) the target makes the states per batch. Samples longer than
    ``max_length`` are cut to their first ``max_length`` tokens.

    Raises :class:`StoreError` when a sample has no stored states, or states of other token ids.
    """

    def __init__(self, samples: list[TokenizedSample], max_length: int, store: HiddenStateStore | None = None):
        if store is not None:
            missing = [s.id for s in samples if s.id not in store]
            if missing:
                raise StoreError(f"{len(missing)} samples have no stored hidden states (first: {missing[0]}); "
                                 f"run `eyas extract` (or `eyas doctor --repair`)")
        self.samples, self.store, self.max_length = samples, store, max_length

    def __len__(self) -> int:
        return len(self.samples)

    def num_tokens(self, i: int) -> int:
        return min(self.samples[i].num_tokens, self.max_length)

    def subset(self, indices: list[int]) -> "SampleDataset":
        """The samples at ``indices``, in that order (e.g. the held-out split)."""
        return SampleDataset([self.samples[i] for i in indices], self.max_length, self.store)

    def __getitem__(self, i: int) -> dict:
        s = self.samples[i]
        n = min(s.num_tokens, self.max_length)
        ids = torch.tensor(s.input_ids, dtype=torch.int64)
        item = {"id": s.id, "input_ids": ids[:n], "loss_mask": torch.tensor(s.loss_mask[:n], dtype=torch.int64)}
        if self.store is None:
            return item
        st = self.store.read(s.id, verify=True)     # the committed checksum: a changed byte stops the run here
        if st.input_ids.shape != ids.shape or not torch.equal(st.input_ids.long(), ids):
            raise StoreError(f"sample {s.id}: stored input_ids differ from the tokenized dataset "
                             f"(stale or foreign hidden states); run `eyas doctor RUN --repair`")
        T, L, H = st.aux.shape
        if st.labels is not None:
            return {**item, "aux": st.aux[:n].reshape(n, L * H), "label_ids": st.labels.ids[:n],
                    "label_probs": st.labels.probs[:n], "label_flags": st.labels.flags[:n]}
        return {**item, "aux": st.aux[:n].reshape(n, L * H), "last": st.last[:n]}


def collate(items: list[dict], pad_to: int = 1) -> dict:
    """Right-pad a list of samples to the longest, rounded up to a multiple of ``pad_to`` (fewer distinct shapes
    for compiled kernels): ``input_ids`` [B, T], ``loss_mask`` [B, T] (0 on padding), ``attention_mask`` [B, T] (1
    on real tokens), ``aux`` [B, T, L*Ht] and ``last`` [B, T, Ht] when the items have them (offline; or
    ``label_ids``, ``label_probs`` [B, T, k] and ``label_flags`` [B, T] from a top-k store, zero on padding),
    ``ids`` list[str]."""
    T = max(len(x["input_ids"]) for x in items)
    T = -(-T // pad_to) * pad_to
    B = len(items)
    out = {
        "input_ids": torch.zeros(B, T, dtype=torch.int64),
        "loss_mask": torch.zeros(B, T, dtype=torch.int64),
        "attention_mask": torch.zeros(B, T, dtype=torch.int64),
        "ids": [x["id"] for x in items],
    }
    states = [k for k in STATE_KEYS if k in items[0]]
    for k in states:
        out[k] = torch.zeros(B, T, *items[0][k].shape[1:], dtype=items[0][k].dtype)
    for b, x in enumerate(items):
        n = len(x["input_ids"])
        out["attention_mask"][b, :n] = 1
        for k in ["input_ids", "loss_mask"] + states:
            out[k][b, :n] = x[k]
    return out


class MicroBatches(torch.utils.data.Dataset):
    """Item ``m`` is this process's collated micro-batch number ``m`` of the run (all epochs in a row), a function
    of (dataset, plan, rank, m) only, so torch's ``DataLoader`` can build batches in worker processes, in any
    order, and a resumed run sees the same ones. A process with no sample in a global micro-batch gets a
    stand-in, sample 0 marked ``weightless`` (the loop zeroes its masks and ids after making its states)."""

    def __init__(self, dataset, plan, rank: int, pad_to: int = 1):
        self.dataset, self.plan, self.rank, self.pad_to = dataset, plan, rank, pad_to

    def __len__(self) -> int:
        return self.plan.total_micro

    def __getitem__(self, micro: int) -> dict:
        idx = self.plan.micro(micro, self.rank)
        batch = collate([self.dataset[i] for i in (idx or [0])], self.pad_to)
        batch["weightless"] = not idx      # the loop zeroes its masks once its states are made
        return batch


def micro_batch_loader(dataset, plan, rank: int, start: int, workers: int, pin_memory: bool, pad_to: int = 1):
    """Micro-batches ``start, start+1, ...`` in order, built ahead by ``workers`` processes (0: in this process)
    into pinned memory when ``pin_memory`` (torch's ``DataLoader``; each worker opens its own store handles)."""
    ds = MicroBatches(dataset, plan, rank, pad_to)
    sampler = range(start, len(ds))
    if workers <= 0:
        return (ds[m] for m in sampler)
    return iter(torch.utils.data.DataLoader(ds, batch_size=None, sampler=sampler, num_workers=workers,
                                            pin_memory=pin_memory, prefetch_factor=4, persistent_workers=False,
                                            collate_fn=_identity))


def _identity(x):
    return x


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The deterministic sample order of one epoch (a function of seed and epoch only, so resume is exact)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def split_held_out(n: int, held_out: int, seed: int) -> tuple[list[int], list[int]]:
    """(train indices, held-out indices): ``held_out`` samples chosen by a seeded permutation (fixed for a run)."""
    if held_out <= 0:
        return list(range(n)), []
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + 17)).tolist()
    held = sorted(order[:held_out])
    keep = set(held)
    return [i for i in range(n) if i not in keep], held


def epoch_plan(lengths: list[int], batch_size: int, world: int, seed: int, epoch: int,
               batch_tokens: int | None = None) -> list[list[list[int]]]:
    """The micro-batches of one epoch: a list of global micro-batches, each a list of ``world`` index lists (one
    per process). A function of (lengths, settings, seed, epoch) only, so a resumed run sees the same batches.

    Without ``batch_tokens``: ``batch_size * world`` samples of the epoch order per global micro-batch, process r
    taking the r-th ``batch_size`` slice (so N processes see exactly one process's ``N * batch_size`` batch, the
    epoch's last, shorter one included: a process may get an empty list there, and the loop gives it a weightless
    stand-in). With ``batch_tokens`` (length buckets): the shuffled order is sorted by length within windows of 64
    batches' worth of samples, cut into batches of at most ``batch_tokens`` padded tokens (a longer sample alone),
    and the batches are shuffled; ``world`` consecutive batches form a global micro-batch (the last one padded with
    empty lists).
    """
    order = epoch_order(len(lengths), seed, epoch)
    if batch_tokens is None:
        g = batch_size * world
        out = [[order[i + r * batch_size: i + (r + 1) * batch_size] for r in range(world)]
               for i in range(0, len(order), g)]
    else:
        window = max(1, 64 * max(1, batch_tokens // max(1, max(lengths))))
        batches: list[list[int]] = []
        for w in range(0, len(order), window):
            chunk = sorted(order[w: w + window], key=lambda i: (-lengths[i], i))
            cur: list[int] = []
            for i in chunk:
                if cur and lengths[cur[0]] * (len(cur) + 1) > batch_tokens:
                    batches.append(cur)
                    cur = []
                cur.append(i)
            if cur:
                batches.append(cur)
        perm = torch.randperm(len(batches), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch + 1))
        batches = [batches[j] for j in perm.tolist()]
        out = [batches[i: i + world] + [[]] * max(0, i + world - len(batches)) for i in range(0, len(batches), world)]
    return out
