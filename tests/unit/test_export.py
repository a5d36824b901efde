"""SGLang export: exact key set, checked before writing; round trip through the loader."""

import json

import pytest
import torch

from eyas.errors import EyasError
from eyas.export.sglang import SGLANG_KEYS, check_sglang_keys, load_sglang_draft, write_sglang
from eyas.model.eagle3 import Eagle3Config, Eagle3DraftModel
from safetensors.torch import load_file


def _model():
    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=16, intermediate_size=23, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=4, target_hidden_size=16, vocab_size=99, draft_vocab_size=13)
    m = Eagle3DraftModel(cfg)
    m.d2t.copy_(torch.arange(13) * 2)
    m.t2d[torch.arange(13) * 3] = True
    return m


def test_export_key_set_and_config(tmp_path):
    m = _model()
    write_sglang(tmp_path, m, [1, 3, 5], "output_of_layer", {"eos_token_id": 2})
    st = load_file(str(tmp_path / "model.safetensors"))
    assert set(st) == SGLANG_KEYS
    assert st["d2t"].dtype == torch.int64 and st["t2d"].dtype == torch.bool
    assert st["fc.weight"].shape == (16, 48) and st["lm_head.weight"].shape == (13, 16)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert cfg["draft_vocab_size"] == 13 and cfg["num_hidden_layers"] == 1 and not cfg["tie_word_embeddings"]
    m2, ids = load_sglang_draft(tmp_path, m.embed_tokens.weight.detach())
    assert ids == [1, 3, 5]
    torch.testing.assert_close(m2.fc.weight, m.fc.weight.bfloat16().float())


def test_hf_index_ids_are_converted_for_sglang(tmp_path):
    write_sglang(tmp_path, _model(), [2, 4, 6], "hf_index", {})
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]


def test_key_check_catches_renamed_and_extra_keys(tmp_path):
    m = _model()
    state = m.trainable_state_dict()
    state["layers.0.mlp.up_proj.weight"] = state.pop("midlayer.mlp.up_proj.weight")
    state["embed_tokens.weight"] = torch.zeros(99, 16)
    problems = check_sglang_keys(state, m.config)
    assert "missing midlayer.mlp.up_proj.weight" in problems
    assert any("embed_tokens.weight" in p for p in problems)
    with pytest.raises(EyasError):
        load_sglang_draft_from(tmp_path, state, m)


def load_sglang_draft_from(tmp_path, state, m):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 16, "intermediate_size": 23, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 4, "vocab_size": 99, "draft_vocab_size": 13}))
    return load_sglang_draft(tmp_path, m.embed_tokens.weight.detach())
