"""The loss mask moves with the targets at every TTT step, at both edges of every assistant turn (issue 19 item 10).

SpecForge issue 885 (fixed by its PR 895): its EAGLE-3 preprocessing shifted the input ids and the teacher's
targets left but not the loss mask, so the position just before an assistant turn went unsupervised and a stale
position at the turn's right edge was supervised. Eyas's contract (eyas/train/loss.py, eyas/model/eagle3.py): step
k at draft position t embeds token t+1+k and predicts token t+2+k, its label is the target's distribution at
s = t+1+k (over token t+2+k), and it is supervised exactly when token t+2+k is an assistant token.

Two samples with two assistant turns each, the expected supervised positions per step written out by hand below
(the second sample's last turn ends on its last token, before padding); checked through the data path (collate),
the draft's TTT forward (which token each step embeds), the labels (which token each supervised position is taught)
and the fused training loss (which positions get a gradient).
"""

from __future__ import annotations

import torch
from tiny import draft_config

from eyas.model.eagle3 import Eagle3DraftModel
from eyas.train.data import collate
from eyas.train.loss import target_labels, ttt_loss, ttt_loss_fused

V = 31          # target vocabulary (= draft vocabulary: no position leaves the loss for the argmax rule)
K = 4           # TTT steps

# Token ids of the two samples; the assistant tokens (loss mask 1) are marked with a caret in the comments.
#                    0   1   2   3   4   5   6   7   8   9  10  11
IDS_A = torch.tensor([1, 11, 12, 21, 22, 23, 13, 14, 24, 25, 26, 15])
MASK_A = [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 0]   # turns at 3..5 and 8..10 (^), then one untrained token
IDS_B = torch.tensor([1, 16, 27, 28, 17, 18, 19, 29, 30, 20])
MASK_B = [0, 0, 1, 1, 0, 0, 0, 1, 1, 1]          # turns at 2..3 and 7..9 (^): the sample ends on its last token

# Supervised draft positions t per step, by hand: t such that token t+2+k is an assistant token (and t >= 0).
# Sample A, assistant tokens {3, 4, 5} and {8, 9, 10}; position:  0  1  2  3  4  5  6  7  8  9 10 11
EXPECT_A = torch.tensor([[0, 1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 0],     # k=0: t = j-2 -> {1,2,3}, {6,7,8}
                         [1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 0, 0],     # k=1: t = j-3 -> {0,1,2}, {5,6,7}
                         [1, 1, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0],     # k=2: t = j-4 -> {0,1}, {4,5,6}
                         [1, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0]])    # k=3: t = j-5 -> {0}, {3,4,5}
# Sample B (10 tokens, 2 of padding), assistant tokens {2, 3} and {7, 8, 9}
EXPECT_B = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0],     # k=0: {0,1}, {5,6,7}
                         [1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0],     # k=1: {0}, {4,5,6}
                         [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0],     # k=2: {}, {3,4,5}
                         [0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]])    # k=3: {}, {2,3,4}
EXPECT = torch.stack([EXPECT_A, EXPECT_B], dim=1).bool()          # [K, B, T]


def _batch():
    items = [{"id": "a", "input_ids": IDS_A, "loss_mask": torch.tensor(MASK_A)},
             {"id": "b", "input_ids": IDS_B, "loss_mask": torch.tensor(MASK_B)}]
    return collate(items)                                         # right-padded to T = 12, as training batches


def _teacher(ids: torch.Tensor):
    """Target states whose distribution at s peaks on the sample's own token s+1 (a target that predicts the data):
    ``last`` [B, T, V] and an lm_head [V, V] near the identity, so a label's argmax names the token it teaches."""
    torch.manual_seed(0)
    head = torch.eye(V, dtype=torch.float64) + 0.05 * torch.randn(V, V, dtype=torch.float64)
    nxt = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)      # token s+1 (0 past the end)
    last = 5.0 * torch.nn.functional.one_hot(nxt, V).double() + 0.1 * torch.randn(*ids.shape, V, dtype=torch.float64)
    return last, head


def _labels(batch):
    last, head = _teacher(batch["input_ids"])
    draft_ids = torch.arange(V)
    t2d = torch.ones(V, dtype=torch.bool)
    labels = target_labels(last, head, draft_ids, t2d, batch["loss_mask"])
    labels.probs = labels.probs.double()
    # the teacher's argmax at s is token s+1 of the sample, at every real position but the last
    real = batch["attention_mask"].bool()
    real[:, :-1] &= real[:, 1:].clone()
    real[:, -1] = False
    nxt = torch.cat([batch["input_ids"][:, 1:], batch["input_ids"][:, :1]], dim=1)
    assert torch.equal(labels.probs.argmax(-1)[real], nxt[real])
    return labels


def test_expected_masks_are_the_assistant_tokens_shifted_by_hand():
    """The hand-written matrices against the rule they state (token t+2+k is an assistant token), and against the
    unshifted mask of SpecForge issue 885 at both edges of each turn: the position before a turn's first trained
    position is supervised, the stale position at its right edge is not."""
    b = _batch()
    m = b["loss_mask"].bool()
    B, T = m.shape
    for k in range(K):
        rule = torch.zeros(B, T, dtype=torch.bool)
        rule[:, : T - 2 - k] = m[:, 2 + k:]
        assert torch.equal(EXPECT[k], rule), k
    # sample A, step 0: t=1 predicts token 3, the turn's first assistant token; t=10 (the last assistant token's
    # own position, predicting token 12: past the sample) and t=9 (predicting the untrained token 11) are not
    assert EXPECT_A[0, 1] and not m[0, 1]
    assert not EXPECT_A[0, 9] and not EXPECT_A[0, 10] and m[0, 9] and m[0, 10]
    # sample B, step 0: t=0 predicts token 2, its first turn's first token; the last real position t=9 is never
    # supervised at any step (nothing after it is predicted)
    assert EXPECT_B[0, 0] and not m[1, 0]
    assert not EXPECT[:, 1, 9:].any() and m[1, 9]


def test_each_step_embeds_token_t_plus_1_plus_k():
    """The predicted token of step k at t is t+2+k because step k embeds token t+1+k (the draft's forward)."""
    b = _batch()
    cfg = draft_config(hidden=20, intermediate=33, heads=4, kv_heads=2, head_dim=6, vocab=V, draft_vocab=V)
    torch.manual_seed(1)
    m = Eagle3DraftModel(cfg).double()
    seen = []
    hook = m.embed_tokens.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].clone()))
    try:
        with torch.no_grad():
            m(b["input_ids"], torch.randn(2, 12, 3 * cfg.target_hidden_size, dtype=torch.float64), K)
    finally:
        hook.remove()
    ids = b["input_ids"]
    assert len(seen) == K
    for k in range(K):
        want = torch.zeros_like(ids)
        want[:, : 12 - 1 - k] = ids[:, 1 + k:]
        assert torch.equal(seen[k], want), k


def test_labels_and_mask_move_together_every_step():
    """Plain loss on leaf logits: the positions with a gradient at step k are exactly EXPECT[k], and the label a
    supervised position is taught (read back from the gradient, softmax(0) - p) is the target's distribution over
    token t+2+k, whose argmax is that token."""
    b = _batch()
    labels = _labels(b)
    ids = b["input_ids"]
    logits = [torch.zeros(2, 12, V, dtype=torch.float64, requires_grad=True) for _ in range(K)]
    loss, metrics = ttt_loss(logits, labels, decay=0.8)
    grads = torch.autograd.grad(loss, logits)
    for k in range(K):
        n = int(EXPECT[k].sum())
        assert metrics[f"count_{k}"] == n, k
        hit = grads[k].abs().sum(-1) > 0                          # [B, T]
        assert torch.equal(hit, EXPECT[k]), (k, hit.int())
        taught = 1.0 / V - grads[k] * n / 0.8 ** k    # p at every supervised position (the loss sums in fp32)
        for bi, t in EXPECT[k].nonzero().tolist():
            torch.testing.assert_close(taught[bi, t], labels.probs[bi, t + 1 + k], rtol=1e-5, atol=1e-7)
            assert int(taught[bi, t].argmax()) == int(ids[bi, t + 2 + k]), (k, bi, t)


def test_fused_training_loss_supervises_exactly_the_expected_positions():
    """The loss training runs (fused lm_head + CE over the draft's own TTT hiddens): step k's hidden gets a
    gradient at exactly EXPECT[k], and the per-step counts are the hand-computed ones."""
    b = _batch()
    labels = _labels(b)
    cfg = draft_config(hidden=20, intermediate=33, heads=4, kv_heads=2, head_dim=6, vocab=V, draft_vocab=V)
    torch.manual_seed(2)
    m = Eagle3DraftModel(cfg).double()
    aux = torch.randn(2, 12, 3 * cfg.target_hidden_size, dtype=torch.float64)
    hs = [h.detach().requires_grad_() for h in m(b["input_ids"], aux, K)]   # each step's hidden as a leaf
    loss, metrics = ttt_loss_fused(hs, m.norm, m.lm_head.weight, labels, 0.8, chunk=5)
    grads = torch.autograd.grad(loss, hs)
    for k in range(K):
        assert int(metrics[f"count_{k}"]) == int(EXPECT[k].sum()), k
        hit = grads[k].abs().sum(-1) > 0
        assert torch.equal(hit, EXPECT[k]), (k, hit.int())
