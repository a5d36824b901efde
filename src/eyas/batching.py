"""The token-budget batching rule, one copy: extraction's batch plan uses it (and so may training's length buckets,
:func:`eyas.train.data.epoch_plan`, which still spells the same rule inline)."""

from __future__ import annotations

from collections.abc import Iterable


def pack_by_token_budget(order: Iterable[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Cut ``order`` (sample indices, longest first) into consecutive batches of at most ``batch_tokens`` padded
    tokens: a batch is cut when its first (longest) sample's length times its size would exceed the budget, so a
    sample longer than the budget forms a batch of its own."""
    batches: list[list[int]] = []
    batch: list[int] = []
    for i in order:
        if batch and lengths[batch[0]] * (len(batch) + 1) > batch_tokens:
            batches.append(batch)
            batch = []
        batch.append(i)
    if batch:
        batches.append(batch)
    return batches


def token_budget_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group sample indices into batches of at most ``batch_tokens`` padded tokens, longest first.

    Sorting (stable: ties keep their order) keeps padding small. Because a batch is cut only by its own samples
    (:func:`pack_by_token_budget`), feeding back the samples of any subset of whole batches, in batch order,
    reproduces exactly those batches (extraction relies on it: a resumed run computes bit-identical states).
    """
    return pack_by_token_budget(sorted(range(len(lengths)), key=lambda i: -lengths[i]), lengths, batch_tokens)
