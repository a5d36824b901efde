"""SGLang export: exact key set, checked before writing; round trip through the one drafter reader."""

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny import draft_config, tiny_draft

from eyas.drafter import drafter_weights, load_drafter
from eyas.errors import EyasError
from eyas.export.keys import SGLANG_KEYS, check_keys
from eyas.export.sglang import write_sglang


def _model():
    return tiny_draft(draft_config(), seed=0, draft_ids=torch.arange(13) * 3)   # H 16, vocab 99, draft vocab 13


def test_export_key_set_and_config(tmp_path):
    m = _model()
    write_sglang(tmp_path, drafter_weights(m, [1, 3, 5], "output_of_layer"), {"eos_token_id": 2})
    st = load_file(str(tmp_path / "model.safetensors"))
    assert set(st) == SGLANG_KEYS
    assert st["d2t"].dtype == torch.int64 and st["t2d"].dtype == torch.bool
    assert st["fc.weight"].shape == (16, 48) and st["lm_head.weight"].shape == (13, 16)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert cfg["draft_vocab_size"] == 13 and cfg["num_hidden_layers"] == 1 and not cfg["tie_word_embeddings"]
    m2, dcfg = load_drafter(tmp_path, m.embed_tokens.weight.detach(), engine="sglang")
    assert dcfg.layer_ids("output_of_layer") == [1, 3, 5]
    torch.testing.assert_close(m2.fc.weight, m.fc.weight.bfloat16().float())


def test_hf_index_ids_are_converted_for_sglang(tmp_path):
    write_sglang(tmp_path, drafter_weights(_model(), [2, 4, 6], "hf_index"), {})
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]


def test_key_check_catches_renamed_and_extra_keys(tmp_path):
    m = _model()
    state = m.trainable_state_dict()
    state["layers.0.mlp.up_proj.weight"] = state.pop("midlayer.mlp.up_proj.weight")
    state["embed_tokens.weight"] = torch.zeros(99, 16)
    problems = check_keys(state, m.config, "sglang")
    assert "missing midlayer.mlp.up_proj.weight" in problems
    assert any("embed_tokens.weight" in p for p in problems)
    # the reader reads a folder as the engine does: SGLang does not map layers.0.* (it would skip the weight)
    _save_folder(tmp_path, state)
    with pytest.raises(EyasError, match="unknown tensor layers.0.mlp.up_proj.weight"):
        load_drafter(tmp_path, m.embed_tokens.weight.detach(), engine="sglang")
    # vLLM maps layers.0.* to the same parameter, and shares the target's table for a same-width draft
    m2, _ = load_drafter(tmp_path, m.embed_tokens.weight.detach(), engine="vllm")
    torch.testing.assert_close(m2.midlayer.mlp.up_proj.weight, m.midlayer.mlp.up_proj.weight)
    del state["midlayer.self_attn.q_proj.weight"]
    _save_folder(tmp_path, state)
    with pytest.raises(EyasError, match="missing midlayer.self_attn.q_proj.weight"):
        load_drafter(tmp_path, m.embed_tokens.weight.detach())


def _save_folder(tmp_path, state):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 16, "intermediate_size": 23,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4, "vocab_size": 99, "draft_vocab_size": 13,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}}))
