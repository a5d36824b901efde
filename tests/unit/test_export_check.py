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
    # against the target alone (no record of the trained layers) vLLM's reading is the default shifted by one: an
    # error (issue 12: every trainer captures the default, so a one-layer shift is a mix-up, not a choice)
    assert any(f.level == "error" and f.engine == "vllm" and "shifted by one" in f.message for f in rep.findings)


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


# ---- issue 12, kind 4: what each engine loads, checked the way each engine reads it ----

def _full_vocab_model():
    return tiny_draft(draft_config(draft_vocab=99), seed=0, draft_ids=torch.arange(99))


def test_full_vocabulary_draft_is_exported_without_d2t_and_checked_so(tmp_path):
    # vLLM builds no d2t parameter when the draft vocabulary is the target's, and raises on one in the weights.
    m = _full_vocab_model()
    write_sglang(tmp_path / "sglang", _drafter(m, TRAINED), TARGET)
    write_vllm(tmp_path / "vllm", _drafter(m, TRAINED), TARGET, verifier="t")
    for fmt, engine in (("sglang", "both"), ("vllm", "vllm")):
        assert "d2t" not in load_file(str(tmp_path / fmt / "model.safetensors"))
        rep = check_folder(tmp_path / fmt, TARGET, TRAINED)
        assert rep.ok_for(engine), rep.to_text()
        m2, dcfg = load_drafter(tmp_path / fmt, m.embed_tokens.weight.detach())
        assert dcfg.layer_ids("output_of_layer") == TRAINED and not m2.d2t.any()          # identity map
    # the converse: a full-vocabulary folder that still carries d2t is refused for vLLM, not for SGLang
    st = load_file(str(tmp_path / "sglang" / "model.safetensors"))
    st["d2t"] = torch.zeros(99, dtype=torch.int64)
    save_file(st, str(tmp_path / "sglang" / "model.safetensors"))
    rep = check_folder(tmp_path / "sglang", TARGET, TRAINED)
    assert rep.ok_for("sglang") and not rep.ok_for("vllm")
    assert any("vLLM builds no d2t parameter" in e for e in _errors(rep, "vllm")), rep.to_text()


def test_every_field_the_engines_take_from_the_draft_is_compared_with_the_target(tmp_path):
    write_sglang(tmp_path, _drafter(_model(), TRAINED), TARGET)     # max_position_embeddings 4096
    assert check_folder(tmp_path, {**TARGET, "max_position_embeddings": 4096}, TRAINED).ok
    rep = check_folder(tmp_path, {**TARGET, "max_position_embeddings": 8192, "vocab_size": 12,
                                  "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, TRAINED)
    text = rep.to_text()
    assert any("max_position_embeddings 4096 is below the target's 8192" in e for e in _errors(rep, "sglang")), text
    assert "draft_vocab_size 13 exceeds the target's vocabulary 12" in text
    assert "rope_scaling None differs" in text


def test_check_exit_status_follows_the_engines_asked(tmp_path):
    from typer.testing import CliRunner

    from eyas.cli import app

    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(TARGET))
    write_vllm(tmp_path / "vllm", _drafter(_model(), TRAINED), TARGET, verifier="t")
    write_sglang(tmp_path / "sglang", _drafter(_model(), TRAINED), TARGET)

    def status(folder, *engine):
        args = ["export", "--check", str(tmp_path / folder), "--target", str(tmp_path / "target"), *engine]
        return CliRunner().invoke(app, args).exit_code

    assert status("vllm") == 0                           # Eyas's own vLLM folder: checked for vLLM, passes
    assert status("vllm", "--engine", "vllm") == 0
    assert status("vllm", "--engine", "sglang") == 1     # SGLang does not load the speculators layout
    assert status("vllm", "--engine", "both") == 1
    assert status("sglang") == status("sglang", "--engine", "both") == status("sglang", "--engine", "sglang") == 0
    assert status("sglang", "--engine", "lmdeploy") == 2


def test_layer_fix_hint_does_not_move_both_engines_one_layer_late(tmp_path):
    # A folder whose eagle_config holds the engines' default in hf_index ([2, 5, 7], vLLM's convention), and no
    # top-level ids: vLLM reads them right, SGLang adds 1. The hint must move SGLang back, not vLLM forward.
    write_sglang(tmp_path, _drafter(_model(), TRAINED), TARGET)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["eagle_aux_hidden_state_layer_ids"]
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 5, 7]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rep = check_folder(tmp_path, TARGET)
    hint = next(e for e in _errors(rep, "vllm") if "one layer earlier" in e)
    assert "set eagle_config's ids to [1, 4, 6] and a top-level eagle_aux_hidden_state_layer_ids = [2, 5, 7]" in hint
    # following the old hint (top-level = SGLang's reading [3, 6, 8]): both engines one layer late, refused
    cfg["eagle_aux_hidden_state_layer_ids"] = [3, 6, 8]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rep = check_folder(tmp_path, TARGET)
    assert not rep.ok_for("sglang") and not rep.ok_for("vllm")
    assert all(any("shifted by one (+1)" in e for e in _errors(rep, eng)) for eng in ("sglang", "vllm")), rep.to_text()
    # following the new hint: both engines capture the default, and the check passes
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 4, 6]
    cfg["eagle_aux_hidden_state_layer_ids"] = [2, 5, 7]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rep = check_folder(tmp_path, TARGET)
    assert rep.ok and rep.captured == {"sglang": [2, 5, 7], "vllm": [2, 5, 7]}, rep.to_text()


def test_full_vocabulary_drafter_folder_round_trips(tmp_path):
    """train/final of a full-vocabulary draft: the model's identity d2t buffer is not written (as engine folders),
    read back as the identity; a d2t that is not the identity is refused (it would have been dropped silently)."""
    from eyas.drafter import read_drafter, write_drafter
    from eyas.errors import EyasError

    d = _drafter(_full_vocab_model(), TRAINED)
    assert "d2t" in d.state
    write_drafter(tmp_path / "final", d)
    back = read_drafter(tmp_path / "final")
    assert not back.state["d2t"].any() and back.state["t2d"].all()
    d.state["d2t"] = d.state["d2t"].clone()
    d.state["d2t"][0] = 5
    with pytest.raises(EyasError, match="not the identity map"):
        write_drafter(tmp_path / "bad", d)
    assert not (tmp_path / "bad").exists()
