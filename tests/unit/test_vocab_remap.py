"""Moving a drafter onto another draft vocabulary (``train.init_from`` with ``train.init_vocab: run``): every weight
but the head is kept, ids in both vocabularies keep their logits exactly, and a new id's row starts from the
target's head through the least-squares fit, which recovers a head that is a linear map of the target's."""

import pytest
import torch

from tiny import draft_config

from eyas.data.vocab import maps_from_ids
from eyas.model.eagle3 import Eagle3DraftModel, remap_draft_vocab

V, H = 99, 24
HT = H   # the target is as wide as the draft (its head [V, HT])


def _drafter(draft_ids, target_head, seed=0):
    torch.manual_seed(seed)
    m = Eagle3DraftModel(draft_config(hidden=H, intermediate=37, heads=4, kv_heads=2, head_dim=6, vocab=V,
                                      draft_vocab=len(draft_ids)))
    d2t, t2d = maps_from_ids(draft_ids, V)
    with torch.no_grad():
        m.d2t.copy_(d2t)
        m.t2d.copy_(t2d)
        # a trained head: a linear map of the target's rows (what the fit assumes), plus a little noise
        m.lm_head.weight.copy_(target_head[draft_ids] @ torch.randn(HT, H) + 0.01 * torch.randn(len(draft_ids), H))
    return m


def test_kept_rows_keep_their_logits_and_new_rows_follow_the_fit():
    target_head = torch.randn(V, HT)
    old_ids = torch.arange(0, 60)                          # the drafter's vocabulary
    new_ids = torch.cat([torch.arange(10, 60), torch.arange(70, 90)])   # 50 kept, 20 new, 10 dropped
    m = _drafter(old_ids, target_head)
    d2t, t2d = maps_from_ids(new_ids, V)
    out, r = remap_draft_vocab(m, d2t, t2d, target_head)
    assert (r.kept, r.new, r.dropped) == (50, 20, 10) and r.fit_cosine > 0.99
    assert out.config.draft_vocab_size == 70 and torch.equal(out.d2t, d2t) and torch.equal(out.t2d, t2d)
    for name, w in m.state_dict().items():                # the body is the drafter's, bit for bit
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(out.state_dict()[name], w), name
    ids, aux = torch.randint(0, V, (2, 11)), torch.randn(2, 11, 3 * HT)
    with torch.no_grad():
        hs_old, hs_new = m(ids, aux, ttt_steps=2), out(ids, aux, ttt_steps=2)
        for a, b in zip(hs_old, hs_new):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
            lo, ln = m.logits(a), out.logits(b)
            torch.testing.assert_close(ln[..., :50], lo[..., 10:60], rtol=0, atol=0)   # same ids, same logits
    # a new id's row is where the drafter's (linear) head would have put it
    map_ = torch.linalg.lstsq(target_head[old_ids], m.lm_head.weight.detach()).solution
    true_rows = target_head[torch.arange(70, 90)] @ map_
    cos = torch.nn.functional.cosine_similarity(out.lm_head.weight[50:].detach(), true_rows, dim=1)
    assert cos.min() > 0.99
    # and it trains: the new rows get gradients
    sum(out.logits(h).logsumexp(-1).sum() for h in out(ids, aux, ttt_steps=2)).backward()
    assert out.lm_head.weight.grad[50:].abs().sum() > 0


def test_too_few_shared_ids_are_refused():
    target_head = torch.randn(V, HT)
    m = _drafter(torch.arange(0, 20), target_head)
    d2t, t2d = maps_from_ids(torch.arange(15, 40), V)    # 5 shared, the fit has HT + 1 = 25 unknowns a column
    with pytest.raises(ValueError, match="share 5 ids"):
        remap_draft_vocab(m, d2t, t2d, target_head)
