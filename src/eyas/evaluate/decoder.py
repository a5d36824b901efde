"""Reference chain speculative decoder (greedy), for acceptance length and a lossless check.

One round (EAGLE-3 chain drafting, verification as in speculative decoding, greedy):
1. the draft proposes k tokens d_1..d_k with its own feature recursion (step 0 takes the target's aux states);
2. the target verifies ``[x_n, d_1..d_k]`` in one forward pass (its KV cache holds everything before x_n);
3. the longest prefix with d_i == argmax target prediction is accepted, plus the target's own next token
   (the bonus token): m + 1 tokens per target forward pass, m accepted draft tokens.
Acceptance length = mean of (m + 1) over rounds, so a drafter that is always wrong scores 1.0 (FIELD_NOTES), the
same quantity vLLM reports as 1 + accepted / drafts.

Caches: the target's ``DynamicCache`` and the draft's :class:`~eyas.model.eagle3.KVCache` are cropped back to
the verified prefix after each round. Draft cache entry j pairs the target's aux states at position j with token
j+1, at position id j, exactly as in training step 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..model.eagle3 import Eagle3DraftModel, KVCache


@dataclass
class DecodeStats:
    """Per-prompt results. ``accepted_per_pos[i]``: rounds whose draft token i+1 was accepted."""

    tokens: list[int]
    rounds: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    target_seconds: float = 0.0
    draft_seconds: float = 0.0

    @property
    def acceptance_length(self) -> float:
        return (self.rounds + self.accepted) / max(self.rounds, 1)


def _aux(hidden_states: tuple, layer_ids: list[int]) -> torch.Tensor:
    """[B, S, L*H] from HF ``output_hidden_states`` (index i+1 = output of 0-based layer i)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


@torch.no_grad()
def speculative_generate(target, draft: Eagle3DraftModel, prompt_ids: list[int], layer_ids: list[int],
                         num_draft_tokens: int, max_new_tokens: int, eos_ids: set[int]) -> DecodeStats:
    """Generate greedily with chain speculative decoding. ``layer_ids`` in the ``output_of_layer`` convention.

    Returns :class:`DecodeStats`; ``tokens`` are the new tokens (stopping at and including an end-of-turn token,
    at most ``max_new_tokens``), which must equal the target's own greedy output.
    """
    from transformers import DynamicCache

    dev = next(target.parameters()).device
    ddev = next(draft.parameters()).device
    d2t = draft.d2t
    k = num_draft_tokens
    cache = DynamicCache()
    t0 = time.perf_counter()
    prompt = torch.tensor([prompt_ids], device=dev)
    out = target(input_ids=prompt, past_key_values=cache, use_cache=True, output_hidden_states=True)
    stats = DecodeStats(tokens=[], accepted_per_pos=[0] * k)
    pending = int(out.logits[0, -1].argmax())          # x_n: produced, not yet fed to the target
    stats.tokens.append(pending)
    aux = _aux(out.hidden_states, layer_ids).to(ddev).float()
    stats.target_seconds += time.perf_counter() - t0
    n = len(prompt_ids)                                 # target cache length (tokens x_0..x_{n-1})
    t0 = time.perf_counter()
    dkv = KVCache()
    draft_in = torch.tensor([prompt_ids[1:] + [pending]], device=ddev)
    h = draft.decode_step(draft_in, aux, torch.arange(n, device=ddev), dkv, from_target=True)
    last_h = h[:, -1:]
    stats.draft_seconds += time.perf_counter() - t0

    while len(stats.tokens) < max_new_tokens and stats.tokens[-1] not in eos_ids:
        # 1. draft k tokens (chain)
        t0 = time.perf_counter()
        drafts: list[int] = []
        hid = last_h
        for j in range(k):
            d = int(draft.logits(hid)[0, -1].argmax())
            d = d + int(d2t[d])                          # draft id -> target id
            drafts.append(d)
            if j < k - 1:
                hid = draft.decode_step(torch.tensor([[d]], device=ddev), hid,
                                        torch.tensor([n + j], device=ddev), dkv, from_target=False)
        dkv.crop(n)
        stats.draft_seconds += time.perf_counter() - t0
        # 2. verify [x_n, d_1..d_k] in one target forward pass
        t0 = time.perf_counter()
        ver = torch.tensor([[pending] + drafts], device=dev)
        out = target(input_ids=ver, past_key_values=cache, use_cache=True, output_hidden_states=True)
        preds = out.logits[0].argmax(-1).tolist()       # preds[i]: target's token after ver[i]
        m = 0
        while m < k and drafts[m] == preds[m]:
            stats.accepted_per_pos[m] += 1
            m += 1
        new = drafts[:m] + [preds[m]]
        _crop(cache, n + 1 + m)
        aux = _aux(out.hidden_states, layer_ids)[:, : m + 1].to(ddev).float()
        stats.target_seconds += time.perf_counter() - t0
        stats.rounds += 1
        stats.accepted += m
        # 3. extend the draft's cache with the verified positions n..n+m (token j+1 paired with position j)
        t0 = time.perf_counter()
        h = draft.decode_step(torch.tensor([new], device=ddev), aux, torch.arange(n, n + m + 1, device=ddev), dkv,
                              from_target=True)
        last_h = h[:, -1:]
        stats.draft_seconds += time.perf_counter() - t0
        n += m + 1
        pending = new[-1]
        for t in new:
            stats.tokens.append(t)
            if t in eos_ids or len(stats.tokens) >= max_new_tokens:
                break
    stats.tokens = _cut(stats.tokens, eos_ids, max_new_tokens)
    return stats


def _crop(cache, keep: int) -> None:
    """Drop cache entries beyond ``keep`` tokens (negative ``crop`` works on transformers 4.4x through 5.x)."""
    extra = cache.get_seq_length() - keep
    if extra > 0:
        cache.crop(-extra)


def _cut(tokens: list[int], eos_ids: set[int], max_new: int) -> list[int]:
    out = []
    for t in tokens[:max_new]:
        out.append(t)
        if t in eos_ids:
            break
    return out


@torch.no_grad()
def target_greedy(target, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """The target's own greedy continuation (transformers ``generate``), cut like :func:`speculative_generate`."""
    dev = next(target.parameters()).device
    out = target.generate(torch.tensor([prompt_ids], device=dev), max_new_tokens=max_new_tokens, do_sample=False,
                          temperature=None, top_p=None, top_k=None, eos_token_id=sorted(eos_ids),
                          pad_token_id=sorted(eos_ids)[0])
    return _cut(out[0, len(prompt_ids):].tolist(), eos_ids, max_new_tokens)
