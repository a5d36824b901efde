"""Reference decoder: greedy chain and tree decoding are lossless; speculative sampling keeps the target's
distribution (chi-square tests with fixed seeds, and a broken rule that the same test rejects)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eyas.evaluate.decoder import (SpecConfig, _Tree, accept, draft_tree, estimated_speedup, speculative_generate,
                                   target_generate)
from eyas.model.eagle3 import Eagle3Config, Eagle3DraftModel, KVCache

V = 11          # target vocabulary
LAYERS = [0, 2, 3]


def _target(seed=0, vocab=V, sharp=4.0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=24, intermediate_size=37, num_hidden_layers=5, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=6, vocab_size=vocab, max_position_embeddings=256,
                      tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(sharp)    # peaked next-token distributions, so drafts get accepted sometimes
    return m


def _draft(target, seed=1, draft_vocab=7):
    torch.manual_seed(seed)
    cfg = Eagle3Config(hidden_size=24, intermediate_size=29, num_attention_heads=4, num_key_value_heads=2, head_dim=6,
                       target_hidden_size=24, vocab_size=target.config.vocab_size, draft_vocab_size=draft_vocab)
    d = Eagle3DraftModel(cfg).eval()
    ids = torch.tensor(sorted(torch.randperm(cfg.vocab_size)[:draft_vocab].tolist()))
    with torch.no_grad():
        d.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        d.d2t.copy_(ids - torch.arange(draft_vocab))
        d.lm_head.weight.mul_(3.0)
    return d


def _chi2_pvalue(observed: torch.Tensor, expected_p: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled into one."""
    n = observed.sum()
    exp = expected_p * n
    small = exp < 5
    o = torch.cat([observed[~small], observed[small].sum()[None]]) if small.any() else observed
    e = torch.cat([exp[~small], exp[small].sum()[None]]) if small.any() else exp
    stat = ((o - e) ** 2 / e).sum()
    return float(torch.special.gammaincc(torch.tensor((len(o) - 1) / 2), stat / 2))


@pytest.mark.parametrize("spec", [SpecConfig(depth=3), SpecConfig(depth=4, topk=3, total_tokens=8),
                                  SpecConfig(depth=2, topk=2)])
def test_greedy_is_lossless(spec):
    target = _target()
    draft = _draft(target)
    eos = {V + 5}       # never produced: run to max_new_tokens
    accepted = 0
    for prompt in ([1, 4, 2, 7], [3, 3, 9], [5]):
        st = speculative_generate(target, draft, prompt, LAYERS, spec, 30, eos)
        assert st.tokens == target_generate(target, prompt, 30, eos).tokens
        assert st.rounds > 0 and 1.0 <= st.acceptance_length <= spec.depth + 1
        assert st.accepted == sum(st.accepted_per_pos)
        assert all(a >= b for a, b in zip(st.accepted_per_pos, st.accepted_per_pos[1:]))
        accepted += st.accepted
    assert accepted > 0     # the accept path was exercised


def test_tree_shape_follows_eagle_dynamic_tree():
    target = _target()
    draft = _draft(target)
    dkv = KVCache()
    prompt = [1, 4, 2, 7]
    from transformers import DynamicCache

    out = target(input_ids=torch.tensor([prompt]), past_key_values=DynamicCache(), output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i + 1] for i in LAYERS], -1)
    h = draft.decode_step(torch.tensor([prompt[1:] + [3]]), aux, torch.arange(4), dkv, from_target=True)
    spec = SpecConfig(depth=3, topk=2, total_tokens=5)
    tree = draft_tree(draft, h[:, -1:], dkv, 4, spec)
    assert len(tree.tokens) == 5 and dkv.length == 4               # the shared cache is left as it was
    assert sum(p == -1 for p in tree.parents) <= 2
    for i, p in enumerate(tree.parents):                           # parents kept, before children, scored higher
        assert p < i and (p == -1 or (tree.depths[p] == tree.depths[i] - 1 and tree.scores[p] >= tree.scores[i]))
    assert all(t in set((draft.d2t + torch.arange(7)).tolist()) for t in tree.tokens)


def _sample_rounds(tree, logits, temperature, n, seed, rule=accept):
    gen = torch.Generator().manual_seed(seed)
    first = torch.zeros(logits.shape[1])
    second = {}
    for _ in range(n):
        path, bonus = rule(tree, logits, temperature, gen)
        emitted = [tree.tokens[i] for i in path] + [bonus]
        first[emitted[0]] += 1
        if path:
            c = path[0]
            second.setdefault(c, torch.zeros(logits.shape[1]))[emitted[1]] += 1
    return first, second


def _tree_and_logits():
    # root with children 3, 5, 0 (score order); node 0 (token 3) has children 1, 3
    tree = _Tree(tokens=[3, 5, 0, 1, 3], parents=[-1, -1, -1, 0, 0], depths=[1, 1, 1, 2, 2],
                 scores=[-0.1, -0.5, -2.0, -0.3, -0.9])
    torch.manual_seed(3)
    logits = torch.randn(1 + 5, 6) * 1.5
    return tree, logits


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_speculative_sampling_keeps_the_target_distribution(temperature):
    tree, logits = _tree_and_logits()
    first, second = _sample_rounds(tree, logits, temperature, 20000, seed=0)
    p_root = torch.softmax(logits[0].double() / temperature, -1)
    assert _chi2_pvalue(first.double(), p_root) > 1e-3
    assert 0 in second      # the first child was accepted some of the time
    p_child = torch.softmax(logits[1].double() / temperature, -1)  # after token 3 (node 0): its own row
    assert _chi2_pvalue(second[0].double(), p_child) > 1e-3


def test_chi_square_rejects_a_biased_acceptance_rule():
    """The same test catches the classic bug of accepting drafts too eagerly (min(1, 2p) instead of p)."""
    def biased(tree, logits, temperature, gen):
        p = torch.softmax(logits[0].double() / temperature, -1)
        for c in [0, 1, 2]:
            if float(torch.rand((), generator=gen, dtype=torch.float64)) < min(1.0, 2 * float(p[tree.tokens[c]])):
                return [c], 0
            p[tree.tokens[c]] = 0
            p /= p.sum()
        return [], int(torch.multinomial(p, 1, generator=gen))

    tree, logits = _tree_and_logits()
    first, _ = _sample_rounds(tree, logits, 1.0, 20000, seed=0, rule=biased)
    assert _chi2_pvalue(first.double(), torch.softmax(logits[0].double(), -1)) < 1e-6


@pytest.mark.e2e
def test_sampled_decoding_matches_target_sampling_end_to_end():
    """Whole decoder, tree drafting, temperature 1, vocabulary 5: the joint law of the first two new tokens
    (p(x1) * p(x2 | x1), computed exactly from the target) is reproduced."""
    target = _target(seed=2, vocab=5, sharp=2.0)
    draft = _draft(target, draft_vocab=4)
    prompt = [1, 3]
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double(), -1)
        joint = torch.stack([p1[a] * torch.softmax(target(torch.tensor([prompt + [a]])).logits[0, -1].double(), -1)
                             for a in range(5)]).flatten()
    counts = torch.zeros(25, dtype=torch.float64)
    spec = SpecConfig(depth=2, topk=2, total_tokens=3, temperature=1.0)
    for s in range(400):
        spec.seed = s
        toks = speculative_generate(target, draft, prompt, LAYERS, spec, 2, set()).tokens
        counts[toks[0] * 5 + toks[1]] += 1
    assert _chi2_pvalue(counts, joint) > 1e-3


def test_speedup_estimate():
    assert estimated_speedup(3.0, 0.01, 0.02, 0.02) == pytest.approx(2.0)
