"""Both export layouts, and `check_folder` reading any folder the way SGLang and vLLM would.

A tiny oddly sized draft (H 16, target vocab 99, draft vocab 13) for a 10-layer target: the EAGLE-3 default aux
layers are output_of_layer [1, 4, 6] = hf_index [2, 5, 7].
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import draft_config, tiny_draft

from eyas.drafter import drafter_weights, load_drafter
from eyas.export.check import MANIFEST, check_folder
from eyas.export.keys import VLLM_KEYS
from eyas.export.layouts import engine_layer_ids
from eyas.export.sglang import write_sglang
from eyas.export.vllm import write_vllm

TARGET = {"num_hidden_layers": 10, "hidden_size": 16, "vocab_size": 99, "rope_theta": 10000.0,
          "architectures": ["LlamaForCausalLM"], "eos_token_id": 2}
TRAINED = [1, 4, 6]     # output_of_layer


def _drafter(m, layer_ids=TRAINED):
    return drafter_weights(m, layer_ids, "output_of_layer")


def _model():
    return tiny_draft(draft_config(), seed=0, draft_ids=torch.arange(13) * 3)   # target ids 0, 3, 6, ...


def _errors(rep, engine):
    return [f.message for f in rep.errors(engine)]


def test_vllm_speculators_folder(tmp_path):
    m = _model()
    write_vllm(tmp_path, _drafter(m), TARGET, verifier="/models/target", num_speculative_tokens=4)
    st = load_file(str(tmp_path / "model.safetensors"))
    assert set(st) == VLLM_KEYS and "layers.0.self_attn.q_proj.weight" in st
    assert st["d2t"].dtype == torch.int64
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["norm_before_residual"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 5, 7]          # hf_index, top level
    assert cfg["draft_vocab_size"] == 13 and cfg["target_hidden_size"] == 16
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["proposal_methods"][0]["speculative_tokens"] == 4
    assert sc["verifier"]["name_or_path"] == "/models/target"
    rep = check_folder(tmp_path, TARGET, TRAINED)
    assert not rep.errors("vllm"), rep.to_text()
    assert rep.captured["vllm"] == [2, 5, 7]
    assert _errors(rep, "sglang")                       # SGLang cannot load this layout: said so
    m2, dcfg = load_drafter(tmp_path, m.embed_tokens.weight.detach())
    assert dcfg.layer_ids("output_of_layer") == TRAINED
    torch.testing.assert_close(m2.midlayer.self_attn.q_proj.weight, m.midlayer.self_attn.q_proj.weight.bfloat16().float())


def test_sglang_folder_is_read_alike_by_both_engines(tmp_path):
    write_sglang(tmp_path, _drafter(_model()), TARGET)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 4, 6]   # SGLang adds 1
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 5, 7]                  # vLLM reads as is
    rep = check_folder(tmp_path, TARGET, TRAINED)
    assert rep.ok, rep.to_text()
    assert rep.captured == {"sglang": [2, 5, 7], "vllm": [2, 5, 7]}


def test_sglang_folder_without_top_level_ids_is_misread_by_vllm(tmp_path):
    write_sglang(tmp_path, _drafter(_model()), TARGET)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["eagle_aux_hidden_state_layer_ids"]     # what other trainers write
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert engine_layer_ids(cfg, 10) == {"sglang": [2, 5, 7], "vllm": [1, 4, 6]}
    rep = check_folder(tmp_path, TARGET)
    assert not _errors(rep, "sglang") or all("vllm" in e.lower() for e in _errors(rep, "sglang"))
    msgs = _errors(rep, "vllm")
    assert any("one layer earlier" in e for e in msgs), rep.to_text()
    # against the target alone (no record of the trained layers) vLLM's reading is the default shifted by one
    assert any(f.level == "warning" and f.engine == "vllm" and "shifted by one" in f.message for f in rep.findings)


def test_shifted_export_is_caught_with_the_manifest(tmp_path):
    # exported with the ids off by one (the hf_index ids passed as output_of_layer): the manifest says what the
    # drafter was trained on, so the check names the shift.
    write_vllm(tmp_path, _drafter(_model(), [2, 5, 7]), TARGET, verifier="t")
    (tmp_path / MANIFEST).write_text(json.dumps({"aux_layer_ids": TRAINED, "layer_convention": "output_of_layer"}))
    rep = check_folder(tmp_path, TARGET)
    msgs = _errors(rep, "vllm")
    assert any("shifted by +1" in e and "[3, 6, 8]" in e for e in msgs), rep.to_text()


def test_misread_fields_are_flagged(tmp_path):
    m = _model()
    write_vllm(tmp_path, _drafter(m), TARGET, verifier="t")
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["norm_before_residual"]
    cfg["speculators_config"]["verifier"] = {}
    cfg["some_new_field"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    st = load_file(str(tmp_path / "model.safetensors"))
    st["d2t"] = st["d2t"].to(torch.bfloat16)        # a float d2t loses large ids
    st["layers.0.extra.weight"] = torch.zeros(2)
    save_file(st, str(tmp_path / "model.safetensors"))
    rep = check_folder(tmp_path, {**TARGET, "vocab_size": 100, "rope_theta": 5e5})
    text = rep.to_text()
    for needle in ("norm_before_residual is missing", "verifier.name_or_path", "d2t is torch.bfloat16",
                   "unknown weight layers.0.extra.weight", "vocab_size 99 differs", "rope_theta"):
        assert needle in text, (needle, text)
    assert "some_new_field" in text                  # reported as ignored, not an error
    assert not any("some_new_field" in e for e in _errors(rep, "vllm"))


def test_d2t_that_holds_target_ids_is_flagged(tmp_path):
    m = _model()
    m.d2t.copy_(torch.arange(13) * 3 + 60)       # target ids written where offsets belong: maps past 99
    write_sglang(tmp_path, _drafter(m), TARGET)
    rep = check_folder(tmp_path, TARGET)
    assert any("d2t" in e for e in _errors(rep, "vllm")), rep.to_text()


def test_not_a_draft_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    rep = check_folder(tmp_path)
    assert rep.layout == "unknown" and not rep.ok
    with pytest.raises(Exception, match="config.json"):
        check_folder(tmp_path / "missing")


@pytest.mark.vllm
def test_vllm_reads_our_speculators_config_as_written(tmp_path):
    """vLLM's own speculators reader (vllm/transformers_utils/configs/speculators) on our config.json."""
    pytest.importorskip("vllm")
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    write_vllm(tmp_path, _drafter(_model()), TARGET, verifier="/models/target",
               num_speculative_tokens=4)
    raw = json.loads((tmp_path / "config.json").read_text())
    spec = SpeculatorsConfig.extract_vllm_speculative_config(raw)
    assert spec == {"method": "eagle3", "num_speculative_tokens": 4}
    hf = SpeculatorsConfig.extract_transformers_pre_trained_config(raw)
    assert hf["architectures"] == ["Eagle3LlamaForCausalLM"] and hf["norm_before_residual"] is False
    assert hf["eagle_aux_hidden_state_layer_ids"] == [2, 5, 7] and hf["draft_vocab_size"] == 13
    assert hf["target_hidden_size"] == 16 and hf["num_hidden_layers"] == 1
