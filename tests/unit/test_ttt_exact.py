"""Training-time test, exactly: the draft's unrolled TTT forward and the loss against a slow reference written out
here (every step recomputed from scratch, attention masks as explicit matrices, RoPE from its formula), in float64.

What the reference fixes (EAGLE-3 arXiv 2503.01840 section 3.2; SpecForge specforge/core/eagle3.py):
- step k at position t embeds token t+1+k, sits at position id t+k, and (k >= 1) takes step k-1's output at t as
  its feature; step 0 takes fc(aux[t]) (aux states are never shifted);
- step k's query at t sees the step-0 keys j <= t and the keys of steps 1..k at t itself;
- step k at t predicts token t+2+k: label = target distribution at s = t+1+k restricted to the draft vocabulary,
  counted when token t+2+k is an assistant token and the target's argmax at s is in the draft vocabulary;
- step k weighs 0.8**k, each step's loss is the mean over its counted positions.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny import draft_config

from eyas.model.attention import ATTENTION, flex_available, flex_block_mask, ttt_mask
from eyas.model.eagle3 import Eagle3DraftModel
from eyas.train.loss import target_labels, ttt_loss, ttt_loss_fused

THETA = 10000.0


def _cfg():
    return draft_config(hidden=20, intermediate=33, heads=4, kv_heads=2, head_dim=6, vocab=53, draft_vocab=17,
                        rope_parameters={"rope_type": "default", "rope_theta": THETA})


def _mask_by_loops(T: int, k: int) -> torch.Tensor:
    m = torch.zeros(T, (k + 1) * T, dtype=torch.bool)
    for t in range(T):
        for j in range(t + 1):
            m[t, j] = True                      # causal prefix of step 0
        for i in range(1, k + 1):
            m[t, i * T + t] = True              # step i's own key at t
    return m


def test_mask_matrices_written_out():
    # T = 4, step 2: [causal | I | I]
    expect = torch.tensor([
        [1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0],
        [1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(ttt_mask(4, 2), expect)
    for T, k in [(1, 0), (5, 0), (7, 1), (9, 6)]:
        assert torch.equal(ttt_mask(T, k), _mask_by_loops(T, k))


@pytest.mark.skipif(not flex_available(), reason="no flex attention in this torch")
def test_flex_block_mask_equals_dense_mask():
    """What flex attends (mask_mod inside the listed partial blocks, everything inside full blocks) is exactly the
    dense mask; key slots of later steps are never read."""
    from torch.nn.attention.flex_attention import create_mask

    for T, k, K in [(5, 0, 3), (130, 2, 3), (257, 3, 4)]:
        bm = flex_block_mask(T, k, K, "cpu")
        P = bm.seq_lengths[0]
        nq, nk = P // 128, K * P // 128
        partial = torch.zeros(nq, nk, dtype=torch.bool)
        full = torch.zeros(nq, nk, dtype=torch.bool)
        for q in range(nq):
            n, nf = int(bm.kv_num_blocks[0, 0, q]), int(bm.full_kv_num_blocks[0, 0, q])
            partial[q, bm.kv_indices[0, 0, q, :n].long()] = True
            full[q, bm.full_kv_indices[0, 0, q, :nf].long()] = True
        assert not (partial & full).any()

        def expand(x):
            return x.repeat_interleave(128, 0).repeat_interleave(128, 1)

        mod = create_mask(bm.mask_mod, None, None, P, K * P, device="cpu")[0, 0]     # [P, K*P]
        seen = (mod & expand(partial)) | expand(full)
        got = torch.cat([seen[:T, s * P: s * P + T] for s in range(k + 1)], dim=1)
        assert torch.equal(got, _mask_by_loops(T, k))
        assert not seen[:T, (k + 1) * P:].any() and not mod[:T, (k + 1) * P:].any()
        for s in range(k + 1):   # padded key positions T..P-1 of every slot are never seen by a real query
            assert not seen[:T, s * P + T:(s + 1) * P].any()


# ---------------------------------------------------------------- the slow reference


def _rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope(x, pos, hd):
    """x [nh, hd] at position id ``pos`` (the default RoPE formula, rotate-half layout)."""
    inv = 1.0 / THETA ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _reference_steps(m: Eagle3DraftModel, ids: torch.Tensor, aux: torch.Tensor, K: int) -> list[torch.Tensor]:
    """One sequence: ids [T], aux [T, 3Ht] -> K tensors [T, H], each step recomputed from scratch."""
    cfg = m.config
    T, nh, nkv, hd = len(ids), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    W = {n: p.detach().double() for n, p in m.named_parameters()}
    eps = cfg.rms_norm_eps

    def token(i):
        return int(ids[i]) if i < T else 0

    def run(upto):
        """Steps 0..upto from scratch; returns the features and keys/values of every step."""
        feat = aux.double() @ W["fc.weight"].T                                  # [T, H]
        keys, vals, outs = [], [], []
        for k in range(upto + 1):
            emb = torch.stack([W["embed_tokens.weight"][token(t + 1 + k)] for t in range(T)])
            x = torch.cat([_rms(emb, W["midlayer.input_layernorm.weight"], eps),
                           _rms(feat, W["midlayer.hidden_norm.weight"], eps)], -1)   # [T, 2H]
            q = (x @ W["midlayer.self_attn.q_proj.weight"].T).view(T, nh, hd)
            kk = (x @ W["midlayer.self_attn.k_proj.weight"].T).view(T, nkv, hd)
            vv = (x @ W["midlayer.self_attn.v_proj.weight"].T).view(T, nkv, hd)
            q = torch.stack([_rope(q[t], t + k, hd) for t in range(T)])          # position id t + k
            kk = torch.stack([_rope(kk[t], t + k, hd) for t in range(T)])
            keys.append(kk)
            vals.append(vv)
            mask = _mask_by_loops(T, k)                                          # [T, (k+1)T]
            kcat, vcat = torch.cat(keys, 0), torch.cat(vals, 0)                  # [(k+1)T, nkv, hd]
            o = torch.zeros(T, nh, hd, dtype=torch.float64)
            for h in range(nh):
                g = h // (nh // nkv)
                s = (q[:, h] @ kcat[:, g].T) / math.sqrt(hd)
                s = s.masked_fill(~mask, float("-inf"))
                o[:, h] = torch.softmax(s, -1) @ vcat[:, g]
            a = o.reshape(T, nh * hd) @ W["midlayer.self_attn.o_proj.weight"].T
            hmid = feat + a
            y = _rms(hmid, W["midlayer.post_attention_layernorm.weight"], eps)
            mlp = (torch.nn.functional.silu(y @ W["midlayer.mlp.gate_proj.weight"].T)
                   * (y @ W["midlayer.mlp.up_proj.weight"].T)) @ W["midlayer.mlp.down_proj.weight"].T
            feat = hmid + mlp
            outs.append(feat)
        return outs

    return [run(k)[k] for k in range(K)]


def _reference_loss(m, steps, last, head, draft_ids, t2d, loss_mask, decay=0.8):
    """steps: per sequence, K tensors [T, H]. Returns (loss, per-step counts)."""
    K = len(steps[0])
    total, counts = 0.0, []
    Wn, Wl = m.norm.weight.detach().double(), m.lm_head.weight.detach().double()
    for k in range(K):
        ce_sum, n = 0.0, 0
        for b, seq in enumerate(steps):
            T = seq[k].shape[0]
            for t in range(T):
                s = t + 1 + k                       # source position of the label; predicts token s+1 = t+2+k
                if s + 1 >= T or not loss_mask[b, s + 1]:
                    continue
                full = last[b, s].double() @ head.double().T
                if not t2d[full.argmax()]:
                    continue
                p = torch.softmax(full[draft_ids], -1)
                logp = torch.log_softmax(Wl @ _rms(seq[k][t], Wn, m.config.rms_norm_eps), -1)
                ce_sum += float(-(p * logp).sum())
                n += 1
        counts.append(n)
        total += decay ** k * (ce_sum / max(n, 1))
    return total, counts


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(7)
    cfg = _cfg()
    m = Eagle3DraftModel(cfg).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    B, T, V = 2, 9, cfg.vocab_size
    ids = torch.randint(0, V, (B, T))
    aux = torch.randn(B, T, 3 * cfg.target_hidden_size, dtype=torch.float64)
    last = torch.randn(B, T, cfg.target_hidden_size, dtype=torch.float64)
    head = torch.randn(V, cfg.target_hidden_size, dtype=torch.float64)
    # draft vocabulary: every target argmax but two, so both branches of the argmax rule occur
    argmaxes = (last @ head.T).argmax(-1).flatten().unique()
    excluded = argmaxes[:2]
    keep = torch.tensor([i for i in range(V) if i not in excluded.tolist()])
    draft_ids = keep[torch.randperm(len(keep))[: cfg.draft_vocab_size - 2]]
    draft_ids = torch.cat([draft_ids, argmaxes[2:4]]).unique().sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 0, 0]])  # row 1: 2 padding
    return m, ids, aux, last, head, draft_ids, t2d, loss_mask


def test_forward_equals_reference_every_step(case):
    m, ids, aux, *_ = case
    K = 4
    m.set_attention("sdpa")
    with torch.no_grad():
        got = m(ids, aux, K)
    for b in range(ids.shape[0]):
        ref = _reference_steps(m, ids[b], aux[b], K)
        for k in range(K):
            torch.testing.assert_close(got[k][b], ref[k], rtol=1e-5, atol=1e-6)  # RoPE tables are fp32


@pytest.mark.skipif(not flex_available(), reason="no flex attention in this torch")
def test_flex_equals_sdpa(case):
    m, ids, aux, last, head, draft_ids, t2d, loss_mask = case
    labels = target_labels(last, head, draft_ids, t2d, loss_mask)
    out = {}
    with torch.no_grad():   # flex attention has no CPU backward; forward parity is what the CPU can check
        for name in ("sdpa", "flex"):
            m.set_attention(name)
            hs = m(ids, aux, 5)
            out[name] = (hs, ttt_loss([m.logits(h) for h in hs], labels, 0.8)[0])
    m.set_attention("sdpa")
    for a, b in zip(out["sdpa"][0], out["flex"][0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert out["flex"][1].item() == pytest.approx(out["sdpa"][1].item(), rel=1e-6)


def test_loss_equals_reference(case):
    m, ids, aux, last, head, draft_ids, t2d, loss_mask = case
    K = 4
    m.set_attention("sdpa")
    labels = target_labels(last, head, draft_ids, t2d, loss_mask)
    labels.probs = labels.probs.double()
    with torch.no_grad():
        hs = m(ids, aux, K)
        plain, metrics = ttt_loss([m.logits(h) for h in hs], labels, 0.8)
    refs = [_reference_steps(m, ids[b], aux[b], K) for b in range(ids.shape[0])]
    ref, counts = _reference_loss(m, refs, last, head, draft_ids, t2d, loss_mask)
    assert [metrics[f"count_{k}"] for k in range(K)] == counts
    assert 0 < counts[-1] < counts[0]                    # the shift removes positions step by step
    assert plain.item() == pytest.approx(ref, rel=1e-6)  # labels are fp32 in target_labels


def test_fused_loss_and_gradients_equal_plain(case):
    m, ids, aux, last, head, draft_ids, t2d, loss_mask = case
    labels = target_labels(last, head, draft_ids, t2d, loss_mask)
    labels.probs = labels.probs.double()
    params = [p for p in m.parameters() if p.requires_grad]
    hs = m(ids, aux, 4)
    plain, pm = ttt_loss([m.logits(h) for h in hs], labels, 0.8)
    g_plain = torch.autograd.grad(plain, params)
    hs = m(ids, aux, 4)
    fused, fm = ttt_loss_fused(hs, m.norm, m.lm_head.weight, labels, 0.8, chunk=3)
    g_fused = torch.autograd.grad(fused, params)
    assert fused.item() == pytest.approx(plain.item(), rel=1e-12)
    for k in range(4):
        assert float(fm[f"acc_{k}"]) == pytest.approx(pm[f"acc_{k}"])
        assert int(fm[f"count_{k}"]) == pm[f"count_{k}"]
    for a, b in zip(g_plain, g_fused):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_gradient_checkpointing_same_gradients(case):
    m, ids, aux, last, head, draft_ids, t2d, loss_mask = case
    labels = target_labels(last, head, draft_ids, t2d, loss_mask)
    params = [p for p in m.parameters() if p.requires_grad]
    grads = []
    for ckpt in (False, True):
        m.gradient_checkpointing = ckpt
        hs = m(ids, aux, 3)
        loss, _ = ttt_loss_fused(hs, m.norm, m.lm_head.weight, labels, 0.8)
        grads.append(torch.autograd.grad(loss, params))
    m.gradient_checkpointing = False
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_attention_registry_is_plain_functions():
    assert set(ATTENTION) >= {"sdpa", "flex"} and all(callable(f) for f in ATTENTION.values())
    with pytest.raises(KeyError):
        Eagle3DraftModel(_cfg()).set_attention("nope")


def test_projection_weights_cast_once_per_forward_under_autocast():
    """Under autocast over fp32 weights the TTT forward casts the layer's seven projections once for all steps
    (:meth:`Eagle3DecoderLayer.ttt_weights`), not once per step: the same hidden states and gradients as letting
    autocast cast inside each step, and no copy without autocast."""
    torch.manual_seed(3)
    m = Eagle3DraftModel(_cfg())
    ids = torch.randint(0, m.config.vocab_size, (2, 7))
    aux = torch.randn(2, 7, 3 * m.config.target_hidden_size)
    assert m.midlayer.ttt_weights(None) is None
    params = [p for n, p in m.named_parameters() if p.requires_grad and n.startswith(("fc.", "midlayer."))]
    casts, runs = [], []
    real = m.midlayer.ttt_weights
    for once in (True, False):
        def spy(dtype, once=once):
            casts.append(dtype)
            return real(dtype) if once else None
        m.midlayer.ttt_weights = spy
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hs = m(ids, aux, 3)
        assert all(h.dtype == torch.bfloat16 for h in hs)    # autocast reached the layer's products
        grads = torch.autograd.grad(sum(h.float().square().sum() for h in hs), params)
        runs.append((hs, grads))
    del m.midlayer.ttt_weights
    assert casts == [torch.bfloat16, torch.bfloat16]          # asked once per forward, not per step
    (h1, g1), (h2, g2) = runs
    for a, b in zip(h1, h2):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(g1, g2):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)
    with torch.no_grad():
        m(ids, aux, 2)
    assert casts == [torch.bfloat16, torch.bfloat16]          # the spy is gone; fp32: no copy (ttt_weights(None))
    w = m.midlayer.ttt_weights(torch.bfloat16)
    assert sorted(w) == ["down", "gate", "k", "o", "q", "up", "v"] and {t.dtype for t in w.values()} == {torch.bfloat16}
