"""Reference decoder: greedy chain and tree decoding are lossless; speculative sampling keeps the target's
distribution (chi-square tests with fixed seeds, and a broken rule that the same test rejects). The whole decoder's
sampled output against the target's exact distribution is in tests/e2e/test_decoder_sampling.py."""

import pytest
import torch
from tiny import chi2_pvalue, draft_for, planted_accept, sharp_target

import eyas.evaluate.decoder as decoder
from eyas.evaluate.decoder import (SpecConfig, _Tree, accept, check_greedy, draft_tree, estimated_speedup,
                                   speculative_generate, target_generate)
from eyas.model.eagle3 import KVCache

V = 11          # target vocabulary
LAYERS = [0, 2, 3]


@pytest.mark.parametrize("spec", [SpecConfig(depth=3), SpecConfig(depth=4, topk=3, total_tokens=8),
                                  SpecConfig(depth=2, topk=2)])
def test_greedy_is_lossless(spec):
    target = sharp_target()
    draft = draft_for(target)
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
    target = sharp_target()
    draft = draft_for(target)
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
    assert chi2_pvalue(first.double(), p_root) > 1e-3
    assert 0 in second      # the first child was accepted some of the time
    p_child = torch.softmax(logits[1].double() / temperature, -1)  # after token 3 (node 0): its own row
    assert chi2_pvalue(second[0].double(), p_child) > 1e-3


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
    assert chi2_pvalue(first.double(), torch.softmax(logits[0].double(), -1)) < 1e-6


def test_speedup_estimate():
    assert estimated_speedup(3.0, 0.01, 0.02, 0.02) == pytest.approx(2.0)


# ---------------------------------------------------------------- the lossless check (check_greedy)


def _judge(target, draft, prompt, spec, max_new=30):
    st = speculative_generate(target, draft, prompt, LAYERS, spec, max_new, {V + 5})
    plain = target_generate(target, prompt, max_new, {V + 5}, reference=st.tokens)
    return st, plain, check_greedy(target, prompt, plain, st.tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lossless_check_passes_a_correct_decoder(dtype):
    """fp32: token for token. bf16: equal, or parted only at a near-tie whose margin is within the tolerance."""
    target = sharp_target()
    draft = draft_for(target)       # the draft stays fp32; only the target's numerics change
    target.to(dtype)
    for prompt, spec in (([1, 4, 2, 7], SpecConfig(depth=3)), ([3, 3, 9], SpecConfig(depth=4, topk=3, total_tokens=8))):
        st, plain, v = _judge(target, draft, prompt, spec)
        if dtype == torch.float32:
            assert v.status == "passed" and plain.parted_at is None
        else:
            assert v.status in ("passed", "parted_at_near_tie")
            if v.status != "passed":
                assert 0 <= v.margin <= v.tolerance and st.tokens[:v.position] == plain.tokens[:v.position]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", [SpecConfig(depth=3), SpecConfig(depth=4, topk=3, total_tokens=8)])
def test_lossless_check_fails_a_planted_token(monkeypatch, dtype, spec):
    """A decoder that emits a token the target would not have chosen fails, in fp32 and in bf16, at that token."""
    target = sharp_target()
    draft = draft_for(target)
    target.to(dtype)
    prompt = [1, 4, 2, 7]
    good = speculative_generate(target, draft, prompt, LAYERS, spec, 30, {V + 5})
    monkeypatch.setattr(decoder, "accept", planted_accept(bad_round=3))
    st, plain, v = _judge(target, draft, prompt, spec)
    assert st.tokens != good.tokens
    assert v.status == "failed" and v.margin > v.tolerance
    assert v.speculative_token == st.tokens[v.position] and v.target_token == plain.tokens[v.position]
    assert st.tokens[:v.position] == good.tokens[:v.position]     # judged at the planted token, not before
    assert v.to_json()["status"] == "failed" and {"position", "margin", "tolerance"} <= set(v.to_json())


def test_lossless_check_needs_the_plain_logits():
    target = sharp_target()
    plain = target_generate(target, [1, 4], 5, set())
    with pytest.raises(ValueError, match="reference=spec_tokens"):
        check_greedy(target, [1, 4], plain, [t + 1 for t in plain.tokens])
