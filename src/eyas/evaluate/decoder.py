"""Reference speculative decoder: chain or EAGLE dynamic-tree drafting, greedy or lossless speculative sampling.

One round (EAGLE-2 arXiv 2406.16858 section 4 for the tree; EAGLE-3 arXiv 2503.01840 for the features):
1. **Draft.** The root is the pending token x_n (produced, not yet fed to the target). The draft expands the tree
   level by level: the ``topk`` best tokens of each frontier node are scored by their cumulative draft
   log-probability, and the ``topk`` best of those become the next frontier (a chain when ``topk == 1``), for
   ``depth`` levels. The ``total_tokens`` best-scored nodes of the whole tree are kept for verification (ties
   broken toward shallower nodes, so every kept node's parent is kept: scores never increase with depth).
2. **Verify.** The target runs ``[x_n] + tree`` in one forward pass with a tree attention mask (each node sees the
   prefix, x_n and its own ancestors; position id = n + depth), so each node's logits are exactly the target's
   next-token distribution after the path to that node.
3. **Accept.** Walking down from the root: greedy (``temperature == 0``) follows the child equal to the target's
   argmax. Sampling (``temperature > 0``) tries the children in score order, each as a point-mass proposal:
   accept child c with probability p(c); on rejection set p(c) = 0 and renormalise; if no child is accepted, sample
   from what is left. This is speculative sampling (Leviathan et al. 2023, Chen et al. 2023) with a deterministic
   draft, applied once per candidate, as SGLang's target-only tree verification does; every emitted token is
   distributed exactly as the target's own sampling at that temperature (tests/unit/test_decoder.py checks it
   with a chi-square test). The round emits the m accepted tokens plus one bonus token from the target.
Acceptance length = mean of (m + 1) over rounds, so a drafter that is always wrong scores 1.0 (FIELD_NOTES), the
same quantity vLLM reports as 1 + accepted / drafts.

Caches: the target's ``DynamicCache`` keeps the prefix plus the accepted path (other tree entries are dropped);
the draft's :class:`~eyas.model.eagle3.KVCache` holds one entry per verified position (entry j pairs the target's
aux states at position j with token j+1, at position id j, as in TTT step 0). Tree nodes are drafted as a batch:
node b's cache is the shared prefix followed by its own ancestors' entries, so one plain causal step is exact.

Shapes: V target vocabulary, Dv draft vocabulary, H draft hidden, L*Ht concatenated aux states, N tree nodes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..model.eagle3 import Eagle3DraftModel, KVCache


@dataclass
class SpecConfig:
    """How to draft and verify. ``depth``: draft levels (chain length); ``topk``: branching (1 = chain);
    ``total_tokens``: tree nodes verified per round (default ``depth`` for a chain, ``topk * depth`` for a tree);
    ``temperature``: 0 = greedy, else speculative sampling of softmax(logits / temperature)."""

    depth: int = 3
    topk: int = 1
    total_tokens: int | None = None
    temperature: float = 0.0
    seed: int = 0

    @property
    def num_nodes(self) -> int:
        full = self.topk + (self.depth - 1) * self.topk * self.topk      # nodes the expansion creates
        want = self.total_tokens or (self.depth if self.topk == 1 else self.topk * self.depth)
        return min(want, full)


@dataclass
class DecodeStats:
    """Per-prompt results. ``accepted_per_pos[i]``: rounds whose draft token at depth i+1 was accepted.
    Times in seconds; ``target_steps``/``draft_steps`` count forward passes (prefill excluded)."""

    tokens: list[int]
    rounds: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    prefill_seconds: float = 0.0
    target_steps: int = 0
    draft_steps: int = 0

    @property
    def acceptance_length(self) -> float:
        return (self.rounds + self.accepted) / max(self.rounds, 1)


@dataclass
class _Tree:
    """Drafted nodes in creation order. parent -1 = the root (pending token); depth 1 = children of the root."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)


def _aux(hidden_states: tuple, layer_ids: list[int]) -> torch.Tensor:
    """[B, S, L*Ht] from HF ``output_hidden_states`` (index i+1 = output of 0-based layer i)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def _draft_logprobs(draft: Eagle3DraftModel, h: torch.Tensor) -> torch.Tensor:
    """Draft log-probabilities over the draft vocabulary [B, Dv] (fp32) from pre-norm hidden states [B, 1, H]."""
    return torch.log_softmax(draft.logits(h)[:, -1].float(), dim=-1)


@torch.no_grad()
def draft_tree(draft: Eagle3DraftModel, root_h: torch.Tensor, dkv: KVCache, n: int, spec: SpecConfig) -> _Tree:
    """Expand the draft tree from ``root_h`` [1, 1, H] (the draft's hidden for the pending token, cache holds
    entries 0..n-1). Returns the kept nodes (target ids), ordered so that parents come before children."""
    ddev = root_h.device
    d2t = draft.d2t
    tree = _Tree()
    ent_k: list = []            # per node: its own draft cache entry (k, v) [1, nkv, 1, hd], once expanded
    ent_v: list = []
    lp = _draft_logprobs(draft, root_h)[0]
    top = torch.topk(lp, spec.topk)
    frontier = []
    for s, d in zip(top.values.tolist(), top.indices.tolist()):
        frontier.append(len(tree.tokens))
        tree.tokens.append(d + int(d2t[d]))
        tree.parents.append(-1)
        tree.depths.append(1)
        tree.scores.append(s)
        ent_k.append(None)
        ent_v.append(None)
    hidden = {-1: root_h}
    for level in range(1, spec.depth):
        # one batched draft step over the frontier: node b attends to the prefix and its own ancestors
        B = len(frontier)
        anc = [_ancestors(tree, i) for i in frontier]                       # root-first, excluding the node
        kv = KVCache()
        kv.k, kv.v = dkv.k.expand(B, -1, -1, -1), dkv.v.expand(B, -1, -1, -1)   # [B, nkv, n, hd]
        if level > 1:
            anc_k = torch.cat([torch.cat([ent_k[a] for a in chain], dim=2) for chain in anc])  # [B, nkv, level-1, hd]
            anc_v = torch.cat([torch.cat([ent_v[a] for a in chain], dim=2) for chain in anc])
            kv.k, kv.v = torch.cat([kv.k, anc_k], dim=2), torch.cat([kv.v, anc_v], dim=2)
        ids = torch.tensor([[tree.tokens[i]] for i in frontier], device=ddev)
        feats = torch.cat([hidden[tree.parents[i]] for i in frontier], dim=0)   # [B, 1, H]
        h = draft.decode_step(ids, feats, torch.tensor([n + level - 1], device=ddev), kv, from_target=False)
        for b, i in enumerate(frontier):
            ent_k[i], ent_v[i] = kv.k[b:b + 1, :, -1:], kv.v[b:b + 1, :, -1:]
            hidden[i] = h[b:b + 1]
        lp = _draft_logprobs(draft, h)                                      # [B, Dv]
        top = torch.topk(lp, spec.topk, dim=-1)
        cand = torch.tensor([tree.scores[i] for i in frontier], device=lp.device)[:, None] + top.values  # [B, k]
        order = torch.argsort(cand.flatten(), descending=True, stable=True).tolist()
        new_frontier = []
        for rank, flat in enumerate(order):
            b, j = divmod(flat, spec.topk)
            d = int(top.indices[b, j])
            idx = len(tree.tokens)
            tree.tokens.append(d + int(d2t[d]))
            tree.parents.append(frontier[b])
            tree.depths.append(level + 1)
            tree.scores.append(float(cand[b, j]))
            ent_k.append(None)
            ent_v.append(None)
            if rank < spec.topk:
                new_frontier.append(idx)
        frontier = new_frontier
    keep = sorted(range(len(tree.tokens)), key=lambda i: (-tree.scores[i], tree.depths[i], i))[: spec.num_nodes]
    keep = sorted(keep, key=lambda i: (tree.depths[i], i))
    remap = {old: new for new, old in enumerate(keep)}
    out = _Tree()
    for i in keep:
        assert tree.parents[i] == -1 or tree.parents[i] in remap, "kept a node without its parent"
        out.tokens.append(tree.tokens[i])
        out.parents.append(remap.get(tree.parents[i], -1))
        out.depths.append(tree.depths[i])
        out.scores.append(tree.scores[i])
    return out


def _ancestors(tree: _Tree, i: int) -> list[int]:
    chain = []
    j = tree.parents[i]
    while j != -1:
        chain.append(j)
        j = tree.parents[j]
    return chain[::-1]


def tree_mask(tree: _Tree, n: int, device) -> torch.Tensor:
    """Bool attention mask [1, 1, 1+N, n+1+N] for the verify pass: prefix and root visible to all; a node sees
    itself and its ancestors."""
    N = len(tree.tokens)
    m = torch.zeros(1 + N, n + 1 + N, dtype=torch.bool, device=device)
    m[:, : n + 1] = True
    for i in range(N):
        m[1 + i, n + 1 + i] = True
        j = tree.parents[i]
        while j != -1:
            m[1 + i, n + 1 + j] = True
            j = tree.parents[j]
    return m[None, None]


def accept(tree: _Tree, logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> tuple[list[int], int]:
    """Walk the verified tree. ``logits`` [1+N, V]: row 0 the root's (pending token's), row 1+i node i's.
    Returns (accepted node indices, root first excluded; the bonus token id)."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents):
        children.setdefault(p, []).append(i)
    for c in children.values():
        c.sort(key=lambda i: -tree.scores[i])
    path, cur = [], -1
    while True:
        row = logits[cur + 1]
        kids = children.get(cur, [])
        if temperature == 0:
            t = int(row.argmax())
            nxt = next((c for c in kids if tree.tokens[c] == t), None)
            if nxt is None:
                return path, t
        else:
            p = torch.softmax(row.double() / temperature, dim=-1)
            nxt = None
            for c in kids:
                tok = tree.tokens[c]
                if float(torch.rand((), generator=gen, dtype=torch.float64)) < float(p[tok]):
                    nxt = c
                    break
                p[tok] = 0.0
                p = p / p.sum()
            if nxt is None:
                return path, int(torch.multinomial(p, 1, generator=gen))
        path.append(nxt)
        cur = nxt


def _additive(mask: torch.Tensor, target) -> torch.Tensor:
    """A bool mask as an additive one (0 where visible, the dtype's minimum elsewhere) in the target's dtype.
    transformers 5.19 passes a user's 4D mask through unchanged, and eager attention (gpt-oss's, with sinks) adds
    it to the scores: a bool mask would add 0/1 instead of masking. SDPA takes either form."""
    dtype = next(target.parameters()).dtype
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def _verify_masks(mask: torch.Tensor, pos: torch.Tensor, n: int, target):
    """The verify pass's masks as the target takes them: additive (:func:`_additive`), and for a target with
    sliding-window layers (gpt-oss, Gemma 3: ``config.layer_types``) a ``{layer type: mask}`` dict in which the
    sliding layers also hide keys ``sliding_window`` or more positions behind the query (transformers' rule
    ``q - k < sliding_window``); a user's 4D mask replaces the model's own, window included. ``pos`` [1, 1+N] the
    verified entries' positions, ``n`` the cached prefix length (positions 0..n-1)."""
    cfg = getattr(target.config, "get_text_config", lambda: target.config)()
    window = getattr(cfg, "sliding_window", None)
    if not window or "sliding_attention" not in (getattr(cfg, "layer_types", None) or ()):
        return _additive(mask, target)
    k_pos = torch.cat([torch.arange(n, device=pos.device), pos[0]])                  # [n+1+N]
    near = (pos[0][:, None] - k_pos[None, :]) < window                                 # [1+N, n+1+N]
    return {"full_attention": _additive(mask, target), "sliding_attention": _additive(mask & near, target)}


def _keep_cache(cache, keep: torch.Tensor) -> None:
    """Keep only sequence positions ``keep`` (int64 [S']) of every layer of a transformers ``DynamicCache``."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(2, keep)
        layer.values = layer.values.index_select(2, keep)


@torch.no_grad()
def speculative_generate(target, draft: Eagle3DraftModel, prompt_ids: list[int], layer_ids: list[int],
                         spec: SpecConfig | int, max_new_tokens: int, eos_ids: set[int]) -> DecodeStats:
    """Generate with speculative decoding. ``layer_ids``: aux layers, ``output_of_layer`` convention; ``spec``: a
    :class:`SpecConfig` or an int (a greedy chain of that length).

    Returns :class:`DecodeStats`; ``tokens`` are the new tokens (stopping at and including an end-of-turn token, at
    most ``max_new_tokens``). Greedy output equals the target's own greedy output; sampled output is distributed as
    the target's sampling at ``spec.temperature``.
    """
    from transformers import DynamicCache

    if isinstance(spec, int):
        spec = SpecConfig(depth=spec)
    dev = next(target.parameters()).device
    ddev = next(draft.parameters()).device
    gen = torch.Generator().manual_seed(spec.seed) if spec.temperature > 0 else None
    cache = DynamicCache()
    t0 = time.perf_counter()
    out = target(input_ids=torch.tensor([prompt_ids], device=dev), past_key_values=cache, use_cache=True,
                 output_hidden_states=True)
    stats = DecodeStats(tokens=[], accepted_per_pos=[0] * spec.depth)
    last = out.logits[0, -1].float()
    pending = (int(last.argmax()) if spec.temperature == 0 else
               int(torch.multinomial(torch.softmax(last.double() / spec.temperature, -1), 1, generator=gen)))
    stats.tokens.append(pending)
    aux = _aux(out.hidden_states, layer_ids).to(ddev).float()
    stats.prefill_seconds += time.perf_counter() - t0
    n = len(prompt_ids)                                 # target cache length (tokens x_0..x_{n-1})
    t0 = time.perf_counter()
    dkv = KVCache()
    h = draft.decode_step(torch.tensor([prompt_ids[1:] + [pending]], device=ddev), aux,
                          torch.arange(n, device=ddev), dkv, from_target=True)
    last_h = h[:, -1:]
    stats.prefill_seconds += time.perf_counter() - t0

    while len(stats.tokens) < max_new_tokens and stats.tokens[-1] not in eos_ids:
        t0 = time.perf_counter()
        tree = draft_tree(draft, last_h, dkv, n, spec)
        stats.draft_seconds += time.perf_counter() - t0
        stats.draft_steps += spec.depth
        t0 = time.perf_counter()
        ver = torch.tensor([[pending] + tree.tokens], device=dev)
        pos = torch.tensor([[n] + [n + d for d in tree.depths]], device=dev)
        out = target(input_ids=ver, position_ids=pos, attention_mask=_verify_masks(tree_mask(tree, n, dev), pos, n,
                                                                                   target),
                     past_key_values=cache, use_cache=True, output_hidden_states=True)
        path, bonus = accept(tree, out.logits[0].float(), spec.temperature, gen)
        rows = torch.tensor([0] + [1 + i for i in path], device=dev)             # verify-pass rows kept
        _keep_cache(cache, torch.cat([torch.arange(n, device=dev), n + rows]))
        aux = _aux(out.hidden_states, layer_ids)[:, rows].to(ddev).float()     # [1, m+1, L*Ht]
        stats.target_seconds += time.perf_counter() - t0
        stats.target_steps += 1
        m = len(path)
        for j in range(m):
            stats.accepted_per_pos[j] += 1
        stats.rounds += 1
        stats.accepted += m
        new = [tree.tokens[i] for i in path] + [bonus]
        # extend the draft's cache with the verified positions n..n+m (token j+1 paired with position j)
        t0 = time.perf_counter()
        h = draft.decode_step(torch.tensor([new], device=ddev), aux, torch.arange(n, n + m + 1, device=ddev), dkv,
                              from_target=True)
        last_h = h[:, -1:]
        stats.draft_seconds += time.perf_counter() - t0
        n += m + 1
        pending = bonus
        for t in new:
            stats.tokens.append(t)
            if t in eos_ids or len(stats.tokens) >= max_new_tokens:
                break
    stats.tokens = _cut(stats.tokens, eos_ids, max_new_tokens)
    return stats


def ngram_propose(tokens: list[int], k: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    """Prompt-lookup (n-gram) drafting, as vLLM's ``ngram`` method proposes (vllm/v1/spec_decode/ngram_proposer.py):
    the longest n in [min_n, max_n] whose last-n-token suffix occurred earlier in ``tokens`` (prompt + output so
    far); of that length, the earliest occurrence; the (up to) ``k`` tokens that followed it. ``[]`` when nothing
    matches."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n:]
        first = suffix[0]
        for i in range(0, total - n):          # the occurrence [i, i+n) ends before the suffix's last token
            if tokens[i] == first and tokens[i: i + n] == suffix:
                return tokens[i + n: i + n + k]
    return []


@torch.no_grad()
def lookup_generate(target, prompt_ids: list[int], k: int, max_new_tokens: int, eos_ids: set[int],
                    min_n: int = 2, max_n: int = 4) -> DecodeStats:
    """Greedy decoding with prompt-lookup drafting (:func:`ngram_propose`), the drafter that needs no training:
    each round verifies ``[pending] + proposal`` (a chain, possibly empty) in one target pass and accepts the
    proposal's prefix that equals the target's argmax. Rounds without a proposal count as rounds with nothing
    accepted, so ``acceptance_length`` is tokens per target forward pass over every verify step (prefill excluded),
    the figure a trained drafter is compared with. Output equals the target's own greedy output."""
    from transformers import DynamicCache

    dev = next(target.parameters()).device
    cache = DynamicCache()
    out = target(input_ids=torch.tensor([prompt_ids], device=dev), past_key_values=cache, use_cache=True)
    pending = int(out.logits[0, -1].argmax())
    stats = DecodeStats(tokens=[pending], accepted_per_pos=[0] * k)
    context = list(prompt_ids) + [pending]
    n = len(prompt_ids)
    while len(stats.tokens) < max_new_tokens and stats.tokens[-1] not in eos_ids:
        t0 = time.perf_counter()
        prop = ngram_propose(context, k, min_n, max_n)
        stats.draft_seconds += time.perf_counter() - t0
        t0 = time.perf_counter()
        out = target(input_ids=torch.tensor([[pending] + prop], device=dev), past_key_values=cache, use_cache=True)
        best = out.logits[0].argmax(-1).tolist()                                  # [1 + len(prop)]
        m = 0
        while m < len(prop) and prop[m] == best[m]:
            m += 1
        _keep_cache(cache, torch.arange(n + 1 + m, device=dev))
        stats.target_seconds += time.perf_counter() - t0
        stats.target_steps += 1
        stats.rounds += 1
        stats.accepted += m
        for j in range(m):
            stats.accepted_per_pos[j] += 1
        new = prop[:m] + [best[m]]
        n += m + 1
        pending = best[m]
        context += new
        for t in new:
            stats.tokens.append(t)
            if t in eos_ids or len(stats.tokens) >= max_new_tokens:
                break
    stats.tokens = _cut(stats.tokens, eos_ids, max_new_tokens)
    return stats


def _cut(tokens: list[int], eos_ids: set[int], max_new: int) -> list[int]:
    out = []
    for t in tokens[:max_new]:
        out.append(t)
        if t in eos_ids:
            break
    return out


@dataclass
class TargetRun:
    """The target decoding alone: new tokens and the measured seconds of each single-token decode step. With a
    ``reference`` (:func:`target_generate`): ``parted_at``, the first step whose token differs from it (None when
    none does), and ``parted_logits``, that step's logits (fp32 [V], this decoding's own numerics)."""

    tokens: list[int]
    step_seconds: list[float]
    parted_at: int | None = None
    parted_logits: torch.Tensor | None = None


@torch.no_grad()
def target_generate(target, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int],
                    temperature: float = 0.0, seed: int = 0, reference: list[int] | None = None) -> TargetRun:
    """The target's own decoding (greedy, or sampling at ``temperature``) with a KV cache, one token per forward
    pass, timed per step: the baseline for the lossless check and for the speedup estimate. ``reference``: another
    decoding's new tokens (the speculative decoder's); the logits of the first step that differs from it are kept
    for :func:`check_greedy` (no extra forward pass)."""
    from transformers import DynamicCache

    dev = next(target.parameters()).device
    gen = torch.Generator().manual_seed(seed) if temperature > 0 else None
    cache = DynamicCache()
    ids = torch.tensor([prompt_ids], device=dev)
    run = TargetRun(tokens=[], step_seconds=[])
    while len(run.tokens) < max_new_tokens and not (run.tokens and run.tokens[-1] in eos_ids):
        t0 = time.perf_counter()
        logits = target(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1].float()
        t = (int(logits.argmax()) if temperature == 0 else
             int(torch.multinomial(torch.softmax(logits.double() / temperature, -1), 1, generator=gen)))
        if ids.shape[1] == 1:
            run.step_seconds.append(time.perf_counter() - t0)
        i = len(run.tokens)
        if reference is not None and run.parted_at is None and (i >= len(reference) or reference[i] != t):
            run.parted_at, run.parted_logits = i, logits
        run.tokens.append(t)
        ids = torch.tensor([[t]], device=dev)
    return run


# ---------------------------------------------------------------- the greedy lossless check

LOSSLESS_STATUSES = ("passed", "parted_at_near_tie", "failed")


@dataclass
class LosslessVerdict:
    """The greedy lossless check of one prompt (:func:`check_greedy`).

    ``status``: ``passed`` (token for token equal to the target's own greedy decoding), ``parted_at_near_tie`` (the
    outputs part at ``position`` where the target's two best candidates are closer than its own numeric noise: a
    correct decoder in bf16), or ``failed`` (the speculative decoder emitted a token the target would not have
    chosen). At the first differing new token (0-based ``position``): ``target_token`` the plain decoding's token a,
    ``speculative_token`` the decoder's b; ``margin`` = z[a] - z[b] >= 0 in the plain decoding's own logits z (fp32
    of the model's output); ``numeric_disagreement`` = max over the vocabulary of |z - z'|, z' the same position's
    logits from one multi-token pass over the prompt and the shared prefix; ``tolerance`` = 2 x that."""

    status: str
    position: int | None = None
    target_token: int | None = None
    speculative_token: int | None = None
    margin: float | None = None
    numeric_disagreement: float | None = None
    tolerance: float | None = None

    def to_json(self) -> dict:
        out = {"status": self.status}
        if self.position is not None:
            out |= {"position": self.position, "target_token": self.target_token,
                    "speculative_token": self.speculative_token, "margin": round(self.margin, 6),
                    "numeric_disagreement": round(self.numeric_disagreement, 6),
                    "tolerance": round(self.tolerance, 6)}
        return out


@torch.no_grad()
def check_greedy(target, prompt_ids: list[int], plain: TargetRun, spec_tokens: list[int]) -> LosslessVerdict:
    """Judge a greedy speculative output ``spec_tokens`` against the target's own greedy decoding ``plain``
    (:func:`target_generate` run with ``reference=spec_tokens``, so it holds its logits z at the first differing
    step i). Returns :class:`LosslessVerdict`; raises ``ValueError`` when the outputs differ and ``plain`` was not
    run with that reference.

    Why a tolerance: greedy decoding is the argmax of logits, and two correct computations of the same logits agree
    only up to rounding. The verify pass runs 1 + N tokens per forward and plain decoding one, so in bf16 their
    matrix products round differently (measured on SmolLM2-135M, bf16, CPU: up to 0.2-0.8 logits apart over the
    vocabulary, bf16's spacing is 0.125 at logit 20), and after a near-tie the two greedy outputs part. The noise at
    position i is measured without the decoder under test: z' = the last row of one multi-token forward pass over
    ``prompt_ids + spec_tokens[:i]`` (plain causal attention, no cache; the prefix is shared, so this is the target's
    next-token logits there), and ``numeric_disagreement`` = max_v |z[v] - z'[v]|. Another computation as far from z
    as z' is can reverse the order of a and b only if z[a] - z[b] <= 2 x that, so such a parting is
    ``parted_at_near_tie`` and any other ``failed``. In exact numerics (fp32 on a CPU, where z' equals z to about
    1e-5) the tolerance all but vanishes and the check is token for token; at i = 0 both outputs come from the same
    prompt prefill, z' is that pass, and any difference fails. The tolerance is not taken from the verify pass's own
    logits: a faulty verify pass (wrong mask, stale cache) would widen its own tolerance. Only the first differing
    token is judged: after it the two outputs continue from different prefixes."""
    if plain.tokens == spec_tokens:
        return LosslessVerdict("passed")
    i = plain.parted_at
    if i is None or i >= len(plain.tokens) or i >= len(spec_tokens) or plain.parted_logits is None:
        raise ValueError("check_greedy: the outputs differ but `plain` holds no logits at their first difference: "
                         "run target_generate with reference=spec_tokens")
    a, b = plain.tokens[i], spec_tokens[i]
    z = plain.parted_logits.float()                                                  # [V]
    dev = next(target.parameters()).device
    z_ref = target(input_ids=torch.tensor([list(prompt_ids) + list(spec_tokens[:i])], device=dev)
                   ).logits[0, -1].float().to(z.device)                              # [V]
    margin = float(z[a] - z[b])
    noise = float((z - z_ref).abs().max())
    status = "parted_at_near_tie" if margin <= 2 * noise else "failed"
    return LosslessVerdict(status, i, a, b, margin, noise, 2 * noise)


def estimated_speedup(acceptance_length: float, draft_seconds_per_round: float, verify_seconds_per_round: float,
                      target_step_seconds: float) -> float:
    """Tokens-per-second gain over plain decoding, from measured times: a round costs one draft tree plus one
    verify pass and yields ``acceptance_length`` tokens; plain decoding costs one target step per token."""
    return acceptance_length * target_step_seconds / max(draft_seconds_per_round + verify_seconds_per_round, 1e-12)
