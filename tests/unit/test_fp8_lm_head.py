"""The draft lm_head's products in fp8 inside the fused loss (``train.fp8_lm_head``): on the CPU, where
``torch._scaled_mm`` has fp8 kernels, the fp8 path gives the loss, the accuracy counts and the gradients of the
high-precision path to fp8's rounding, pads ragged chunks, and refuses shapes fp8 products cannot take."""

from __future__ import annotations

import pytest
import torch

from eyas.train.loss import TargetLabels, ttt_loss_fused


def _case(seed: int = 0, B: int = 2, T: int = 37, H: int = 64, Dv: int = 96, K: int = 3):
    g = torch.Generator().manual_seed(seed)
    hs = [torch.randn(B, T, H, generator=g, requires_grad=True) for _ in range(K)]
    weight = (torch.randn(Dv, H, generator=g) * 0.2).requires_grad_(True)
    probs = torch.softmax(torch.randn(B, T, Dv, generator=g) * 3, dim=-1)
    valid = torch.rand(B, T, generator=g) > 0.2
    return hs, weight, TargetLabels(probs=probs, valid=valid)


def _run(hs, weight, labels, fp8: bool, chunk: int):
    norm = torch.nn.RMSNorm(weight.shape[1])
    loss, metrics = ttt_loss_fused(hs, norm, weight, labels, 0.8, chunk=chunk, fp8=fp8)
    grads = torch.autograd.grad(loss, [weight, *hs])
    return loss.detach(), metrics, grads


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


@pytest.mark.parametrize("chunk", [16, 13, 2048])   # whole chunks of 16; ragged chunks padded; one chunk per step
def test_fp8_lm_head_matches_high_precision(chunk):
    hs, weight, labels = _case()
    ref_loss, ref_m, ref_g = _run(hs, weight, labels, False, chunk)
    loss, m, g = _run(hs, weight, labels, True, chunk)
    assert float(loss) == pytest.approx(float(ref_loss), rel=2e-2)
    for k in range(3):
        assert int(m[f"count_{k}"]) == int(ref_m[f"count_{k}"])
        # fp8 logits may flip a near tie's argmax, rarely
        assert abs(float(m[f"hits_{k}"]) - float(ref_m[f"hits_{k}"])) <= 0.05 * int(ref_m[f"count_{k}"])
    for a, b in zip(g, ref_g):
        assert _cos(a, b) > 0.99
        assert float(a.norm() / b.norm()) == pytest.approx(1.0, abs=0.05)   # the scales undone exactly


def test_fp8_lm_head_padding_gives_zero_gradient_past_the_end():
    """Positions past a step's last label get no gradient, with fp8 as without (padding rows carry none)."""
    hs, weight, labels = _case(T=21)
    _, _, g = _run(hs, weight, labels, True, 16)
    for k, gx in enumerate(g[1:]):
        n_rows = 21 - 1 - k
        assert torch.count_nonzero(gx[:, n_rows:]) == 0
        assert torch.count_nonzero(gx[:, :n_rows]) > 0


def test_fp8_lm_head_refuses_shapes_that_are_not_multiples_of_16():
    hs, weight, labels = _case(H=64, Dv=90)
    with pytest.raises(ValueError, match="multiples of 16"):
        _run(hs, weight, labels, True, 16)


# ---------------------------------------------------------------- the setting in the loop

def test_unavailable_says_why_for_devices_and_shapes():
    from eyas.train.fp8 import fp8_lm_head_unavailable

    cpu = torch.device("cpu")
    assert fp8_lm_head_unavailable(cpu, (48, 32)) == "this run is on cpu"
    assert fp8_lm_head_unavailable(cpu, (48, 32), capability=(8, 0)) == "this GPU has compute capability 8.0"
    assert fp8_lm_head_unavailable(cpu, (48, 32), capability=(9, 0)) is None
    assert "not multiples of 16" in fp8_lm_head_unavailable(cpu, (50, 32), capability=(9, 0))


def test_cpu_run_falls_back_to_the_plain_run_bit_for_bit_and_says_so(tmp_path):
    from test_train_loop import ToySet, _losses, toy_cfg, toy_model  # tests/unit is on sys.path

    from eyas.train.loop import train

    data, runs, logs = ToySet(6, seed=21), {}, []
    for name, on in (("off", False), ("on", True)):
        m, head = toy_model()
        runs[name] = train(m, data, head, toy_cfg(fp8_lm_head=on, epochs=2), tmp_path / name, torch.device("cpu"),
                           {}, log=logs.append)
    assert _losses(tmp_path / "on") == _losses(tmp_path / "off")
    for k, v in runs["off"].final_state.items():
        assert torch.equal(v, runs["on"].final_state[k]), k
    assert runs["on"].fp8_lm_head is False
    assert logs == ["[eyas] train: train.fp8_lm_head is not used: this run is on cpu: the lm_head's products stay "
                    "in float32"]


def test_loop_runs_the_fp8_lm_head_where_the_device_can(tmp_path, monkeypatch):
    """With the device check answered yes (the CPU's torch._scaled_mm has fp8 kernels), the loop trains through the
    fp8 products: its losses follow the plain run's to fp8 rounding, and the result says fp8 was used."""
    from test_fp8_setting import draft16
    from test_train_loop import ToySet, _losses, toy_cfg
    from tiny import set_vocab

    from eyas.train import loop as loop_module
    from eyas.train.loop import train

    def model():
        m = draft16()
        set_vocab(m, torch.arange(0, 96, 2))
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            m.embed_tokens.weight.copy_(torch.randn(m.embed_tokens.weight.shape, generator=g))
        return m, torch.randn(m.embed_tokens.weight.shape, generator=g) * 2

    g = torch.Generator().manual_seed(21)
    data = ToySet(6, seed=21)                     # its layout, with states 32 wide (the fp8-sized draft's)
    for it in data.items:
        T = it["input_ids"].shape[0]
        it.update(aux=torch.randn(T, 3 * 32, generator=g), last=torch.randn(T, 32, generator=g))
    m, head = model()
    plain = train(m, data, head, toy_cfg(epochs=2), tmp_path / "off", torch.device("cpu"), {}, log=lambda s: None)
    monkeypatch.setattr(loop_module, "fp8_lm_head_unavailable", lambda device, shape: None)
    m, head = model()
    fp8 = train(m, data, head, toy_cfg(fp8_lm_head=True, epochs=2), tmp_path / "on", torch.device("cpu"), {},
                log=lambda s: None)
    assert fp8.fp8_lm_head is True and plain.fp8_lm_head is False
    a, b = _losses(tmp_path / "off"), _losses(tmp_path / "on")
    assert [s for s, _ in a] == [s for s, _ in b]
    assert a != b                                                         # the fp8 products were used
    for (_, x), (_, y) in zip(a, b):
        assert y == pytest.approx(x, rel=5e-2)
