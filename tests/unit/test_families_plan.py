"""Per-family facts (eyas.families), the draft config derived from them, a narrower draft's own embedding through
export and load, and eyas.plan's arithmetic. Published config shapes come from ``FAMILIES[...].reference``."""

from __future__ import annotations

import pytest
import torch

from eyas.config import DraftConfig
from eyas.errors import ConfigError
from eyas.drafter import drafter_weights, load_drafter
from eyas.export.keys import check_keys
from eyas.export.sglang import write_sglang
from eyas.families import (
    FAMILIES,
    GENERIC,
    convert_layer_ids,
    default_aux_layer_ids,
    draft_attention_defaults,
    family_of,
    rope_parameters,
)
from eyas.plan import hidden_state_bytes_per_token, parameter_counts
from eyas.train.build import build_draft, draft_config_for, projected_embedding

KIMI = FAMILIES["deepseek_v3"].reference["Kimi-K2-Instruct"]
DSV3 = FAMILIES["deepseek_v3"].reference["DeepSeek-V3"]
LLAMA = FAMILIES["llama3"].reference["Llama-3.1-8B-Instruct"]


def test_family_of_by_model_type_architecture_and_text_config():
    assert family_of(KIMI) is FAMILIES["deepseek_v3"]  # model_type kimi_k2
    assert family_of({"model_type": "unknown", "architectures": ["GptOssForCausalLM"]}) is FAMILIES["gpt_oss"]
    assert family_of({"model_type": "kimi_k25", "text_config": dict(KIMI)}) is FAMILIES["deepseek_v3"]
    assert family_of({"model_type": "mystery"}) is GENERIC
    for name, fam in FAMILIES.items():
        for ref in fam.reference.values():
            assert family_of(ref) is fam, name


def test_aux_layers_engine_defaults_both_conventions():
    # Kimi-K2 / DeepSeek-V3, N = 61: SGLang eagle_config [1, 29, 57]; vLLM / speculators hf_index [2, 30, 58].
    assert default_aux_layer_ids(61, KIMI) == [1, 29, 57]
    assert convert_layer_ids([1, 29, 57], "output_of_layer", "hf_index") == [2, 30, 58]
    assert default_aux_layer_ids(32, LLAMA) == [1, 15, 28]
    assert default_aux_layer_ids(24, FAMILIES["gpt_oss"].reference["gpt-oss-20b"]) == [1, 11, 20]
    with pytest.raises(ConfigError, match="extract.layer_ids"):
        default_aux_layer_ids(5, LLAMA)
    assert not FAMILIES["gemma3"].vllm_eagle3 and FAMILIES["gemma3"].sglang_eagle3


def test_rope_parameters_per_family():
    # v4 fields: DeepSeek-V3 writes rope_scaling with "type"; it becomes rope_type, theta is kept.
    rp = rope_parameters(DSV3)
    assert rp == {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                  "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
    assert rope_parameters(LLAMA)["rope_type"] == "llama3" and rope_parameters(LLAMA)["rope_theta"] == 500000.0
    # Gemma 3 (transformers 5): nested per layer type; the draft takes the full-attention layers' RoPE.
    gemma = {"model_type": "gemma3_text", "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}}
    assert rope_parameters(gemma) == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}
    assert rope_parameters({"model_type": "qwen3", "rope_theta": 1e6}) == {"rope_type": "default", "rope_theta": 1e6}


def test_draft_config_mla_uses_v_head_dim_and_yarn():
    d = draft_attention_defaults(KIMI)
    assert (d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"]) == (64, 64, 128)
    cfg = draft_config_for(KIMI, DraftConfig(), draft_vocab_size=32000, num_aux_layers=3)
    assert (cfg.hidden_size, cfg.target_hidden_size, cfg.vocab_size) == (7168, 7168, 163840)
    assert cfg.max_position_embeddings == 131072 and cfg.rope_parameters["rope_type"] == "yarn"
    assert not cfg.own_embedding
    narrow = draft_config_for(KIMI, DraftConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8),
                              draft_vocab_size=32000, num_aux_layers=3)
    assert (narrow.hidden_size, narrow.target_hidden_size, narrow.head_dim) == (4096, 7168, 128)
    assert narrow.own_embedding
    with pytest.raises(ValueError, match="multiple"):      # refused where the config is read (pydantic)
        DraftConfig(num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(ConfigError, match="multiple"):      # and where the target fills in the rest
        draft_config_for(KIMI, DraftConfig.model_construct(num_attention_heads=6, num_key_value_heads=4), 32000, 3)


def test_narrower_draft_keeps_its_own_embedding_through_export_and_load(tmp_path):
    torch.manual_seed(0)
    V, Ht, H, Dv = 97, 40, 24, 31
    target = {"model_type": "llama", "hidden_size": Ht, "intermediate_size": 53, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 10, "vocab_size": V, "num_hidden_layers": 8}
    cfg = draft_config_for(target, DraftConfig(hidden_size=H, num_attention_heads=3, num_key_value_heads=1,
                                               head_dim=8), Dv, 3)
    embed = torch.randn(V, Ht)
    ids = torch.arange(0, 2 * Dv, 2)
    d2t = ids - torch.arange(Dv)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    model = build_draft(cfg, embed, d2t, t2d, seed=0)
    assert model.embed_tokens.weight.shape == (V, H) and model.embed_tokens.weight.requires_grad
    torch.testing.assert_close(model.embed_tokens.weight.detach(), projected_embedding(embed, H))
    state = model.trainable_state_dict()
    assert state["embed_tokens.weight"].shape == (V, H) and check_keys(state, cfg, "sglang") == []
    assert check_keys({k: v for k, v in state.items() if k != "embed_tokens.weight"}, cfg, "sglang") == [
        "missing embed_tokens.weight"]
    out = write_sglang(tmp_path / "sglang", drafter_weights(model, [1, 3, 4], "output_of_layer"), target,
                       dtype=torch.float32)
    loaded, dcfg = load_drafter(out, engine="sglang")  # no target table needed: this draft has its own
    assert dcfg.layer_ids("output_of_layer") == [1, 3, 4] and dcfg.own_embedding
    torch.testing.assert_close(loaded.embed_tokens.weight, model.embed_tokens.weight.detach())
    aux = torch.randn(1, 5, 3 * Ht)
    tok = torch.randint(0, V, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tok, aux, 2)[1], model(tok, aux, 2)[1])


def test_projected_embedding_keeps_the_leading_directions():
    torch.manual_seed(0)
    low = torch.randn(200, 6) @ torch.randn(6, 32)  # rank 6
    p = projected_embedding(low, 6)
    # Rank-6 table: the projection onto its 6 singular directions keeps every pairwise inner product.
    torch.testing.assert_close(p @ p.T, low @ low.T, rtol=1e-4, atol=1e-3)


def test_plan_arithmetic_field_notes():
    # FIELD_NOTES rule 5: 3 aux + last in bf16 = 8 * H bytes per token: 32 KiB at H = 4096, 56 KiB at H = 7168.
    assert hidden_state_bytes_per_token(4096, 3) == 32 * 1024
    assert hidden_state_bytes_per_token(7168, 3) == 56 * 1024
    assert round(hidden_state_bytes_per_token(7168, 3) * 90e6 / 1e12, 1) == 5.2  # TB per 90M tokens
    assert hidden_state_bytes_per_token(7168, 3, aux_fp8=True) == 3 * (7168 + 4) + 2 * 7168


@pytest.mark.parametrize("ref,total_b,active_b", [
    # Published totals (the model cards): Kimi-K2 1T / 32B active, DeepSeek-V3 671B / 37B active, Qwen3-30B-A3B
    # 30.5B / 3.3B active, gpt-oss-20b 21B / 3.6B active, Llama-3.1-8B 8.0B.
    (KIMI, 1000, 32), (DSV3, 671, 37), (FAMILIES["qwen3_moe"].reference["Qwen3-30B-A3B"], 30.5, 3.3),
    (FAMILIES["gpt_oss"].reference["gpt-oss-20b"], 21, 3.6), (LLAMA, 8.0, 8.0),
])
def test_parameter_counts_near_published(ref, total_b, active_b):
    total, active = parameter_counts(ref)
    assert total / 1e9 == pytest.approx(total_b, rel=0.08)
    # active excludes embeddings and lm_head (prefill for extraction never runs the lm_head)
    assert active / 1e9 == pytest.approx(active_b, rel=0.2)
