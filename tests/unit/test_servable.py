"""Issue 12, kind 4: a drafter no engine serves is refused when the run starts (config load, or the first stage that
knows the target), with the field and the engine rule; what each engine loads is exported and checked alike.

The rules (eyas.families.servable_problems) were read from SGLang's llama_eagle3.py / llama.py and vLLM 0.32's
llama_eagle3.py / llama.py / interfaces.py (see the comments there)."""

from __future__ import annotations


import pytest
import yaml

from eyas.config import load_config
from eyas.errors import ConfigError
from eyas.families import FAMILIES, servable_problems
from eyas.stages import RunContext, init_run_dir, run_stage


@pytest.mark.parametrize("ids, why", [([1, 2, 3, 4], "the engines serve exactly 3"),
                                      ([1, 2], "the engines serve exactly 3"),
                                      ([3, 1, 2], "distinct and ascending"),
                                      ([1, 1, 2], "distinct and ascending"),
                                      ([-1, 2, 3], "not negative")])
def test_aux_layers_the_engines_cannot_serve_are_refused_at_config_time(ids, why):
    with pytest.raises(ConfigError, match=rf"extract\.layer_ids: .*{why}"):
        load_config("demo", [f"extract.layer_ids={ids}"])


def _stories_run(tmp_path, stories_dir, shared, **sections):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join((shared / "data" / "train" / "gsm8k_train.jsonl").open().readlines()[:3]))
    cfg = {"run_dir": str(tmp_path / "run"), "target": {"model": str(stories_dir)},
           "prepare": {"sources": [{"path": str(data)}]}}
    for k, v in sections.items():
        cfg.setdefault(k, {}).update(v)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ctx = RunContext(cfg=load_config(path), log=lambda m: None)
    init_run_dir(ctx, ["test"])
    return ctx


def test_last_layer_output_is_refused_for_sglang_before_any_work(tmp_path, stories_dir, shared):
    # stories260K has 5 layers: SGLang captures the inputs of layers 1..4, i.e. outputs of 0..3, never layer 4's.
    ctx = _stories_run(tmp_path, stories_dir, shared, extract={"layer_ids": [1, 2, 4]})
    with pytest.raises(ConfigError, match=r"extract\.layer_ids: \[4\] outside 0\.\.3 for a 5-layer target \(SGLang"):
        run_stage(ctx, "prepare")
    assert not (tmp_path / "run" / "prepare" / "conversations.jsonl").exists()
    # vLLM 0.32 also captures after the last layer: a vLLM-only export may use it.
    ctx = _stories_run(tmp_path, stories_dir, shared, extract={"layer_ids": [1, 2, 4]}, export={"formats": ["vllm"]})
    assert run_stage(ctx, "prepare").samples == 3


def test_draft_vocabulary_above_the_targets_is_refused_at_prepare(tmp_path, stories_dir, shared):
    ctx = _stories_run(tmp_path, stories_dir, shared, vocab={"draft_vocab_size": 600})
    with pytest.raises(ConfigError, match=r"vocab\.draft_vocab_size: 600 exceeds the target vocabulary \(512\)"):
        run_stage(ctx, "prepare")


def test_engines_that_do_not_serve_a_family_are_refused():
    gemma = FAMILIES["gemma3"].reference["gemma-3-1b-it"]
    errors, _ = servable_problems(gemma, layer_ids=None, draft_vocab_size=32000, formats=["sglang"])
    assert errors == []                               # SGLang serves Gemma 3
    errors, _ = servable_problems(gemma, layer_ids=None, draft_vocab_size=32000, formats=["sglang", "vllm"],
                                  evaluate_engine="vllm")
    assert [e.split(":")[0] for e in errors] == ["export.formats", "evaluate.engine"]
    assert all("vllm does not serve an EAGLE-3 drafter for Gemma 3" in e for e in errors)
    kimi = FAMILIES["deepseek_v3"].reference["Kimi-K2-Instruct"]
    assert servable_problems(kimi, layer_ids=[1, 29, 60], draft_vocab_size=32000, formats=["sglang"])[0] == [
        "extract.layer_ids: [60] outside 0..59 for a 61-layer target (SGLang captures the inputs of decoder layers "
        "1..60, i.e. outputs of layers 0..59, never the last layer's output)"]


def test_default_draft_vocabulary_never_exceeds_the_targets():
    from eyas.config import VocabConfig

    assert VocabConfig().size_for(512) == 512            # stories260K: the whole vocabulary (exported without d2t)
    assert VocabConfig().size_for(128256) == 32000       # Llama 3: the usual 32,000
    assert VocabConfig(draft_vocab_size=300).size_for(512) == 300
