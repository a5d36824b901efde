"""The vLLM capture backend's parts that need no engine: layer ids in vLLM's convention, the validation of each
sample read from the connector, the connector's row gathering from the hidden-state cache, its atomic file writer,
and the target's own final norm (vLLM's last state is pre-norm; the store's is post-norm).

The engine itself runs in tests/e2e/test_extract_vllm.py."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eyas.capture.vllm_backend import (
    VllmBackend,
    VllmCaptureError,
    check_capture,
    engine_layers,
    load_final_norm,
    make_backend,
    rows_from_blocks,
    write_atomic,
)
from eyas.config import ExtractConfig, TargetConfig
from eyas.errors import ConfigError
from eyas.records import TokenizedSample


@pytest.mark.parametrize("n, ours, engine", [
    (30, [1, 14, 26], [2, 15, 27, 30]),   # SmolLM2-135M
    (32, [1, 15, 28], [2, 16, 29, 32]),   # Llama-3.1-8B
    (61, [1, 29, 57], [2, 30, 58, 61]),   # DeepSeek-V3 / Kimi-K2 (FIELD_NOTES: hf_index [2, 30, 58])
])
def test_engine_layer_ids_are_hf_index_plus_the_last_layer(n, ours, engine):
    m = engine_layers(ours, n)
    assert m.engine_ids == engine
    assert m.aux_rows == [0, 1, 2] and m.last_row == 3


def test_engine_layer_ids_share_a_row_when_an_aux_layer_is_the_last():
    # output of layer N-1 is hf_index N, which is also where vLLM takes the (pre-norm) last state
    m = engine_layers([0, 3, 5], 6)
    assert m.engine_ids == [1, 4, 6] and m.aux_rows == [0, 1, 2] and m.last_row == 2
    with pytest.raises(ValueError, match="0..5"):
        engine_layers([0, 3, 6], 6)


def _sample(n=5):
    return TokenizedSample("conv-17", [11, 12, 13, 14, 15][:n], [1] * n)


def test_check_capture_accepts_the_right_states():
    check_capture(_sample(), torch.tensor([11, 12, 13, 14, 15]), torch.randn(5, 4, 7), 4, 7, "f.safetensors")


@pytest.mark.parametrize("ids, hidden, message", [
    ([11, 12, 13, 99, 15], torch.zeros(5, 4, 7), r"conv-17: f.safetensors: .*token ids differ .*position 3"),
    ([11, 12, 13, 14], torch.zeros(4, 4, 7), r"conv-17: .*\(4 vs 5 tokens, first difference at position 4\)"),
    ([11, 12, 13, 14, 15], torch.zeros(5, 3, 7), r"conv-17: .*shape \(5, 3, 7\), expected \[T=5, L=4, H=7\]"),
    ([11, 12, 13, 14, 15], torch.zeros(5, 4, 7, dtype=torch.int32), r"conv-17: .*not floating"),
])
def test_check_capture_names_the_sample_and_the_fault(ids, hidden, message):
    with pytest.raises(VllmCaptureError, match=message):
        check_capture(_sample(), torch.tensor(ids), hidden, 4, 7, "f.safetensors")


def test_check_capture_finds_a_non_finite_value():
    h = torch.zeros(5, 4, 7, dtype=torch.bfloat16)
    h[3, 2, 6] = float("inf")
    with pytest.raises(VllmCaptureError, match=r"conv-17: .*non-finite .* = \[3, 2, 6\]"):
        check_capture(_sample(), torch.tensor([11, 12, 13, 14, 15]), h, 4, 7, "f.safetensors")


def test_rows_from_blocks_follows_the_block_table():
    blocks, L, bs, H = 6, 3, 4, 5
    cache = torch.arange(blocks * L * bs * H, dtype=torch.float32).reshape(blocks, L, bs, H)
    table, T = [4, 1, 3], 10                    # tokens 0-3 in block 4, 4-7 in block 1, 8-9 in block 3
    got = rows_from_blocks(cache, table, T)
    want = torch.stack([cache[table[t // bs], :, t % bs] for t in range(T)])  # [T, L, H]
    assert got.shape == (T, L, H) and torch.equal(got, want)
    assert got.data_ptr() != cache.data_ptr()   # a copy: the blocks are freed once the file is written
    assert torch.equal(rows_from_blocks(cache, table + [0], 8), want[:8])
    with pytest.raises(ValueError, match="need 3 blocks"):
        rows_from_blocks(cache, [4, 1], T)


def test_write_atomic_leaves_only_the_complete_file(tmp_path):
    from safetensors.torch import load_file

    path = tmp_path / "req-1.safetensors"
    t = {"hidden_states": torch.randn(3, 2, 5, dtype=torch.bfloat16), "token_ids": torch.tensor([1, 2, 3])}
    write_atomic(str(path), t)
    assert [p.name for p in tmp_path.iterdir()] == ["req-1.safetensors"]
    back = load_file(str(path))
    assert all(torch.equal(back[k], v) for k, v in t.items())


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A random Llama (hidden 36) saved as safetensors, with a non-trivial final norm weight."""
    cfg = LlamaConfig(hidden_size=36, intermediate_size=70, num_hidden_layers=6, num_attention_heads=3,
                      num_key_value_heads=1, head_dim=12, vocab_size=99, max_position_embeddings=128,
                      rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
    out = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(out)
    return out, model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_final_norm_is_the_targets_own(tiny_target, dtype):
    path, model = tiny_target
    norm = load_final_norm(path, dtype)
    assert type(norm).__name__ == "LlamaRMSNorm"
    ref = type(norm)(36, eps=model.config.rms_norm_eps)
    ref.load_state_dict(model.model.norm.state_dict())
    x = (torch.randn(9, 36) * 40).to(dtype)     # a pre-norm residual stream
    with torch.no_grad():
        assert torch.equal(norm(x), ref.to(dtype)(x))


def test_final_norm_turns_the_last_layer_output_into_last_hidden_state(tiny_target):
    path, model = tiny_target
    seen = {}
    hook = model.model.layers[-1].register_forward_hook(lambda m, i, o: seen.update(pre=o[0] if isinstance(o, tuple)
                                                                                    else o))
    try:
        with torch.no_grad():
            out = model.model(torch.tensor([[5, 17, 3, 98, 41]]))
    finally:
        hook.remove()
    with torch.no_grad():   # seen["pre"]: what vLLM captures at hf_index N
        torch.testing.assert_close(load_final_norm(path, torch.float32)(seen["pre"]), out.last_hidden_state)


def test_capture_settings_cannot_be_overridden(tiny_target):
    path, _ = tiny_target
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        VllmBackend(path, [0, 2, 3], engine_args={"enable_prefix_caching": True, "enforce_eager": True})


def test_torchrun_data_parallel_is_refused(tiny_target, monkeypatch):
    path, _ = tiny_target
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="torchrun"):
        make_backend(TargetConfig(model=str(path)), ExtractConfig(backend="vllm"), [0, 2, 3], None)
