"""Top-k soft labels (eyas.store.labels) against the labels training makes from the last hidden state
(eyas.train.loss.target_labels), and the checks that guard them (written by extract, re-read by eyas doctor)."""

from __future__ import annotations

import pytest
import torch

from eyas.store.labels import (LabelMaker, check_labels, dense_labels, label_bytes_per_token, label_id_dtype,
                               smallest_k)
from eyas.store.space import store_bytes_per_token
from eyas.train.loss import stored_labels, target_labels, ttt_loss


def _vocab(V: int, Dv: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(V, generator=g)[:Dv].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(Dv), t2d, ids


def test_top_k_labels_equal_the_last_states_labels():
    torch.manual_seed(0)
    V, H, Dv, B, T = 400, 24, 120, 2, 9
    d2t, t2d, ids = _vocab(V, Dv)
    lm_head = torch.randn(V, H) * 2
    last = torch.randn(B, T, H)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 6:] = 0
    ref = target_labels(last, lm_head, ids, t2d, mask)
    maker = LabelMaker(lm_head, d2t, t2d, Dv, dtype=torch.float32, chunk=5)     # every id; chunks of 5 rows
    lab = maker(last.reshape(-1, H))
    assert lab.ids.dtype == torch.int16 and lab.probs.dtype == torch.float16 and check_labels(
        lab.ids, lab.probs, lab.flags, Dv) is None
    got = stored_labels(lab.ids.view(B, T, -1), lab.probs.view(B, T, -1), lab.flags.view(B, T), Dv, mask)
    assert torch.equal(got.valid, ref.valid)
    assert (got.probs - ref.probs).abs().max() < 1e-3                   # fp16 rounding of the probabilities
    # a small k: the argmax and the top probabilities are kept, each row still sums to 1, the rest spread evenly
    k = 6
    lk = LabelMaker(lm_head, d2t, t2d, k, dtype=torch.float32)(last.reshape(-1, H))
    gk = stored_labels(lk.ids.view(B, T, k), lk.probs.view(B, T, k), lk.flags.view(B, T), Dv, mask)
    assert torch.equal(gk.probs.argmax(-1), ref.probs.argmax(-1))
    assert torch.allclose(gk.probs.sum(-1), torch.ones(B, T), atol=1e-3)
    top = ref.probs.topk(k, dim=-1)
    assert torch.allclose(gk.probs.gather(-1, top.indices), top.values, atol=1e-3)
    # the loss follows: its top-k cross-entropy is within the mass it drops of the exact one
    logits = [torch.randn(B, T, Dv) for _ in range(2)]
    exact, _ = ttt_loss(logits, ref, 0.8)
    approx, _ = ttt_loss(logits, gk, 0.8)
    rest = 1 - float(top.values.sum(-1).min())
    assert abs(float(approx) - float(exact)) < 10 * max(rest, 1e-3) * float(exact)
    # the mass curve is measured and non-decreasing; the smallest k holding a mass is read from it
    curve = LabelMaker(lm_head, d2t, t2d, 4, dtype=torch.float32)
    curve(last.reshape(-1, H))
    c = curve.curve()
    assert list(c.values()) == sorted(c.values()) and c[Dv] == pytest.approx(1.0, abs=1e-5)
    assert smallest_k(c, 0.5) == min(k for k, m in c.items() if m >= 0.5)


def test_dense_labels_keeps_padding_empty_and_full_k_exact():
    ids = torch.tensor([[[2, 0]], [[0, 1]]])
    probs = torch.tensor([[[0.6, 0.3]], [[0.0, 0.0]]])
    d = dense_labels(ids, probs, 4)
    assert torch.allclose(d[0, 0], torch.tensor([0.3, 0.05, 0.6, 0.05]))
    assert torch.equal(d[1, 0], torch.zeros(4))                              # a padded row stays empty
    assert torch.equal(dense_labels(torch.tensor([[1, 0]]), torch.tensor([[0.75, 0.25]]), 2),
                       torch.tensor([[0.25, 0.75]]))


def test_check_labels_names_each_planted_fault():
    ids = torch.tensor([[3, 1]], dtype=torch.int16)
    probs = torch.tensor([[0.5, 0.25]], dtype=torch.float16)
    flags = torch.tensor([1], dtype=torch.uint8)
    assert check_labels(ids, probs, flags, 4) is None
    assert "outside the draft vocabulary" in check_labels(torch.tensor([[4, 1]]), probs, flags, 4)
    assert "not sorted" in check_labels(ids, probs.flip(-1), flags, 4)
    assert "outside [0, 1]" in check_labels(ids, torch.tensor([[float("nan"), 0.1]]), flags, 4)
    assert "sum to" in check_labels(ids, torch.tensor([[0.9, 0.8]]), flags, 4)
    assert "flags" in check_labels(ids, probs, torch.tensor([2], dtype=torch.uint8), 4)


def test_bytes_per_token_of_each_store_format():
    """What the issue sizes: 8H + 4 in bf16, fp8 aux 3(H + 4) + 2H + 4, fp8 aux + top-32 labels 3(H + 4) + 4 + 129:
    0.38x of bf16 at the Kimi-K2 shape (H 7,168)."""
    H = 7168
    bf16 = store_bytes_per_token(H, 3, "bfloat16", "same")
    fp8 = store_bytes_per_token(H, 3, "bfloat16", "float8_e4m3fn")
    topk = store_bytes_per_token(H, 3, "bfloat16", "float8_e4m3fn", 32, 32000)
    assert (bf16, fp8, topk) == (8 * H + 4, 3 * (H + 4) + 2 * H + 4, 3 * (H + 4) + 4 + 32 * 4 + 1)
    assert round(topk / bf16, 2) == 0.38
    assert label_id_dtype(32767) == torch.int16 and label_id_dtype(32768) == torch.int32
    assert label_bytes_per_token(32, 65536) == 32 * 6 + 1
