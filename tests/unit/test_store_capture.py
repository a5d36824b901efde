"""The transformers capture backend equals transformers' own ``output_hidden_states`` (tiny random Llama)."""

import pytest
import torch
from tiny import tiny_target

from eyas.capture import CaptureBackend
from eyas.batching import token_budget_batches
from eyas.capture.transformers_backend import TransformersBackend
from eyas.records import TokenizedSample
from eyas.store.fp8 import dequantize_fp8

LAYERS = [0, 2, 4]  # output_of_layer ids of a 6-layer target


@pytest.fixture(scope="module")
def model():
    return tiny_target(hidden=36, layers=6, heads=3, kv_heads=1, head_dim=12, vocab=99)


@pytest.fixture(scope="module")
def samples():
    g = torch.Generator().manual_seed(3)
    lengths = [13, 1, 29, 7, 29, 16, 3]
    return [TokenizedSample(f"id{i}", torch.randint(0, 99, (n,), generator=g).tolist(), [1] * n)
            for i, n in enumerate(lengths)]


def _reference(model, s):
    """``output_hidden_states`` of the sample alone (no padding): index i+1 is the output of layer i."""
    with torch.no_grad():
        out = model(torch.tensor([s.input_ids]), output_hidden_states=True)
    hs = out.hidden_states
    return torch.stack([hs[i + 1][0] for i in LAYERS], dim=1), hs[-1][0]  # [T, L, H], [T, H] (post-norm)


@pytest.mark.parametrize("store_dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, None)])
def test_states_equal_output_hidden_states(model, samples, store_dtype, atol):
    backend = TransformersBackend(model, LAYERS, batch_tokens=60, store_dtype=store_dtype)
    assert isinstance(backend, CaptureBackend)
    got = {c.sample_id: c for c in backend.capture(samples)}
    backend.close()
    assert sorted(got) == sorted(s.id for s in samples)
    for s in samples:
        aux_ref, last_ref = _reference(model, s)
        c = got[s.id]
        assert c.input_ids.tolist() == s.input_ids
        assert c.aux.dtype == store_dtype and c.aux.shape == (s.num_tokens, len(LAYERS), 36)
        if atol is None:  # bf16: equal to the reference rounded to bf16, up to one rounding step
            torch.testing.assert_close(c.aux.float(), aux_ref.bfloat16().float(), rtol=2**-7, atol=1e-6)
            torch.testing.assert_close(c.last.float(), last_ref.bfloat16().float(), rtol=2**-7, atol=1e-6)
        else:
            torch.testing.assert_close(c.aux, aux_ref, rtol=0, atol=atol)
            torch.testing.assert_close(c.last, last_ref, rtol=0, atol=atol)


def test_fp8_capture_quantises_on_the_device(model, samples):
    backend = TransformersBackend(model, LAYERS, batch_tokens=60, store_dtype=torch.bfloat16,
                                  aux_format="float8_e4m3fn")
    for c in backend.capture(samples[:3]):
        aux_ref, _ = _reference(model, next(s for s in samples if s.id == c.sample_id))
        assert c.aux.dtype == torch.float8_e4m3fn and c.aux_scale.shape == aux_ref.shape[:2]
        back = dequantize_fp8(c.aux, c.aux_scale, torch.float32)
        rel = (back - aux_ref).norm() / aux_ref.norm()
        assert rel < 0.05
    backend.close()


def test_hooks_removed_on_close(model, samples):
    before = [len(layer._forward_hooks) for layer in model.model.layers]
    backend = TransformersBackend(model, LAYERS, batch_tokens=60, store_dtype=torch.float32)
    assert [len(layer._forward_hooks) for layer in model.model.layers] == [
        n + (i in LAYERS) for i, n in enumerate(before)]  # hooks only on the aux layers
    backend.close()
    assert [len(layer._forward_hooks) for layer in model.model.layers] == before


def test_batches_of_whole_batch_subsets_are_reproduced():
    lengths = [5, 9, 9, 3, 12, 1, 7, 7, 2, 30]
    plan = list(token_budget_batches(lengths, 24))
    assert all(lengths[b[0]] * len(b) <= 24 or len(b) == 1 for b in plan)
    for keep in ([0, 2], [1], [len(plan) - 1, 1]):
        keep = sorted(keep)
        subset = [i for k in keep for i in plan[k]]
        again = [[subset[j] for j in b] for b in token_budget_batches([lengths[i] for i in subset], 24)]
        assert again == [plan[k] for k in keep]


def test_make_backend_loads_the_base_model_with_device_map(model, samples, tmp_path):
    from eyas.capture import make_backend
    from eyas.config import ExtractConfig, TargetConfig

    model.save_pretrained(tmp_path / "target")
    target = TargetConfig(model=str(tmp_path / "target"), dtype="float32", device="cpu")
    backend = make_backend("transformers", target, ExtractConfig(layer_ids=LAYERS, dtype="float32", batch_tokens=60,
                                                                 device_map="auto"), LAYERS, None)
    assert type(backend.model).__name__ == "LlamaModel"  # no lm_head loaded
    assert backend.engine["compute_dtype"] == "float32" and backend.engine["device_map"] == "auto"
    for c in backend.capture(samples[:3]):
        aux_ref, last_ref = _reference(model, next(s for s in samples if s.id == c.sample_id))
        torch.testing.assert_close(c.aux, aux_ref, rtol=0, atol=1e-5)
        torch.testing.assert_close(c.last, last_ref, rtol=0, atol=1e-5)
    backend.close()


class _WithExtraRequest:
    """The real transformers backend, plus one capture the stage did not ask for (an engine's warm-up or health
    check request) or with other token ids, yielded first."""

    def __init__(self, backend, sample_id, token_shift):
        self.backend, self.sample_id, self.token_shift = backend, sample_id, token_shift
        self.engine = backend.engine

    def capture(self, samples):
        from dataclasses import replace

        captured = list(self.backend.capture(samples))
        extra = replace(captured[0], sample_id=self.sample_id or captured[0].sample_id,
                        input_ids=captured[0].input_ids + self.token_shift)
        yield extra
        yield from captured

    def close(self):
        self.backend.close()


@pytest.mark.parametrize("sample_id, token_shift, message", [("warmup-0", 0, "'warmup-0', which was not asked for"),
                                                             (None, 1, "other token ids")])
def test_extract_stores_only_what_it_asked_for(model, samples, tmp_path, monkeypatch, sample_id, token_shift,
                                               message):
    from eyas.capture import make_backend
    from eyas.config import RunConfig
    from eyas.errors import StoreError
    from eyas.store import HiddenStateStore, StoreHeader, extraction

    model.save_pretrained(tmp_path / "target")
    cfg = RunConfig.model_validate({
        "run_dir": str(tmp_path / "run"), "target": {"model": str(tmp_path / "target"), "device": "cpu"},
        "prepare": {"sources": [{"path": "unused.jsonl"}]},
        "extract": {"layer_ids": LAYERS, "dtype": "float32", "batch_tokens": 60}})
    header = StoreHeader(run_id="r", target={}, tokenizer={}, layer_ids=LAYERS, layer_convention="output_of_layer",
                         last_hidden="post_norm", hidden_size=36, dtype="float32", engine={"name": "transformers"})
    store = HiddenStateStore.create_or_open(tmp_path / "store", header)
    monkeypatch.setattr(extraction, "make_backend",
                        lambda *a, **k: _WithExtraRequest(make_backend(*a, **k), sample_id, token_shift))
    with pytest.raises(StoreError, match=message):
        extraction.extract_missing(cfg.target, cfg.extract, store, samples, log=lambda m: None)
    assert len(HiddenStateStore.open(tmp_path / "store")) == 0  # nothing reached the store
