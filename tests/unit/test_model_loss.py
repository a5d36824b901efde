"""The draft model and the TTT loss on a tiny odd shape."""

import pytest
import torch

from tiny import draft_config

from eyas.model.eagle3 import Eagle3DraftModel, KVCache
from eyas.train.loss import target_labels, ttt_loss


def _cfg():
    return draft_config(hidden=24, intermediate=37, heads=4, kv_heads=2, head_dim=6, vocab=99, draft_vocab=31)


def test_forward_shapes_and_export_keys():
    torch.manual_seed(0)
    m = Eagle3DraftModel(_cfg())
    ids = torch.randint(0, 99, (2, 11))
    aux = torch.randn(2, 11, 72)
    outs = m(ids, aux, ttt_steps=3)
    assert len(outs) == 3 and all(o.shape == (2, 11, 24) for o in outs)
    assert m.logits(outs[0]).shape == (2, 11, 31)
    keys = set(m.trainable_state_dict())
    assert not any(k.startswith("embed_tokens") for k in keys)
    assert {"fc.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight"} <= keys


def test_step0_equals_cached_decoding():
    """TTT step 0 over a sequence equals incremental decoding with the KV cache (same causal attention)."""
    torch.manual_seed(1)
    m = Eagle3DraftModel(_cfg()).eval()
    ids = torch.randint(0, 99, (1, 9))
    aux = torch.randn(1, 9, 72)
    with torch.no_grad():
        full = m(ids, aux, ttt_steps=1)[0]
        kv = KVCache()
        shifted = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)
        a = m.decode_step(shifted[:, :5], aux[:, :5], torch.arange(5), kv, from_target=True)
        b = m.decode_step(shifted[:, 5:], aux[:, 5:], torch.arange(5, 9), kv, from_target=True)
    torch.testing.assert_close(torch.cat([a, b], 1), full, atol=1e-5, rtol=1e-5)


def test_ttt_step1_equals_chain_drafting():
    """TTT step 1 at position t equals drafting one more token after anchor t with the decode path."""
    torch.manual_seed(2)
    m = Eagle3DraftModel(_cfg()).eval()
    T = 8
    ids = torch.randint(0, 99, (1, T))
    aux = torch.randn(1, T, 72)
    with torch.no_grad():
        steps = m(ids, aux, ttt_steps=2)
        for t in range(T - 2):
            kv = KVCache()
            shifted = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)
            h0 = m.decode_step(shifted[:, : t + 1], aux[:, : t + 1], torch.arange(t + 1), kv, from_target=True)
            h1 = m.decode_step(ids[:, t + 2: t + 3], h0[:, -1:], torch.tensor([t + 1]), kv, from_target=False)
            torch.testing.assert_close(h1[0, 0], steps[1][0, t], atol=1e-5, rtol=1e-5)


def test_loss_alignment_and_masking():
    B, T, V, H = 1, 6, 10, 4
    last = torch.randn(B, T, H)
    head = torch.randn(V, H)
    draft_ids = torch.tensor([0, 2, 3, 5, 7, 9])
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    mask = torch.tensor([[0, 0, 1, 1, 1, 0]])
    lab = target_labels(last, head, draft_ids, t2d, mask)
    full = last @ head.T
    for s in range(T - 1):
        expect = bool(mask[0, s + 1]) and bool(t2d[full[0, s].argmax()])
        assert bool(lab.valid[0, s]) == expect
    assert not lab.valid[0, T - 1]
    # a perfect draft (logits = log of the soft labels at s = t+1+k) reaches the entropy floor on every step
    steps = []
    for k in range(2):
        lg = torch.full((B, T, len(draft_ids)), -30.0)
        lg[:, : T - 1 - k] = lab.probs[:, 1 + k:].log()
        steps.append(lg)
    loss, m = ttt_loss(steps, lab, decay=0.8)
    assert m["acc_0"] == 1.0 and m["acc_1"] == 1.0
    p = lab.probs
    ent = [(-(p[:, 1 + k:] * p[:, 1 + k:].log()).sum(-1) * lab.valid[:, 1 + k:]).sum() /
           lab.valid[:, 1 + k:].sum().clamp(min=1) for k in range(2)]
    assert loss.item() == pytest.approx(float(ent[0] + 0.8 * ent[1]), rel=1e-4)
