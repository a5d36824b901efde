"""Widening a drafter's MLP (``train.init_from`` with a larger ``train.draft.intermediate_size``): the wider
draft computes what the narrow one did, at every TTT step, until training moves it; and it can be trained."""

import pytest
import torch

from tiny import draft_config

from eyas.model.eagle3 import Eagle3DraftModel, widen_mlp


def _model(seed=0):
    torch.manual_seed(seed)
    return Eagle3DraftModel(draft_config(hidden=24, intermediate=37, heads=4, kv_heads=2, head_dim=6, vocab=99,
                                         draft_vocab=31))


def test_widened_draft_computes_the_same_and_learns():
    m = _model()
    with torch.no_grad():   # a drafter that has been trained: d2t and every weight non-default
        m.d2t.copy_(torch.randint(0, 60, (31,)))
        m.midlayer.mlp.down_proj.weight.normal_()
    w = widen_mlp(m, 100, seed=3)
    assert w.config.intermediate_size == 100 and m.config.intermediate_size == 37
    assert w.midlayer.mlp.gate_proj.weight.shape == (100, 24) and w.midlayer.mlp.down_proj.weight.shape == (24, 100)
    assert torch.equal(w.d2t, m.d2t) and torch.equal(w.fc.weight, m.fc.weight)
    ids, aux = torch.randint(0, 99, (2, 13)), torch.randn(2, 13, 72)
    with torch.no_grad():
        a, b = m(ids, aux, ttt_steps=3), w(ids, aux, ttt_steps=3)
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-6)
    # the new channels are live: their down_proj columns get a gradient at once
    sum(o.square().sum() for o in w(ids, aux, ttt_steps=3)).backward()
    assert w.midlayer.mlp.down_proj.weight.grad[:, 37:].abs().sum() > 0
    # seeded: the same widening twice is the same model
    again = widen_mlp(m, 100, seed=3)
    assert torch.equal(again.midlayer.mlp.up_proj.weight, w.midlayer.mlp.up_proj.weight)


def test_narrowing_is_refused():
    with pytest.raises(ValueError, match="widened, not narrowed"):
        widen_mlp(_model(), 20)
