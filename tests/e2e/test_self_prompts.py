"""prepare.self_prompts (Magpie): the target writes user turns from its own template; they join the prepared
conversations as one-turn prompts, every asked prompt accounted for (kept, cut off, empty, repeated)."""

from __future__ import annotations

import json

import pytest
import yaml

from eyas.config import load_config
from eyas.generation.self_prompts import user_turn_prefix
from eyas.stages import RunContext, run_stage

pytestmark = pytest.mark.e2e


def test_self_prompts_join_the_prepared_conversations(tmp_path, shared, stories_dir):
    # stories260K has no chat turns: let BOS (where llama2.c's run.c stops a story) and "." (id 426) end a
    # self-prompt, so each is a sentence or two
    import shutil

    target = tmp_path / "target"
    shutil.copytree(stories_dir, target)
    gc = json.loads((target / "generation_config.json").read_text()) if (target / "generation_config.json").exists() \
        else {}
    (target / "generation_config.json").write_text(json.dumps({**gc, "eos_token_id": [1, 2, 426]}))
    cfg = {
        "run_dir": str(tmp_path / "run"),
        "target": {"model": str(target), "dtype": "float32", "device": "cpu"},
        "prepare": {"sources": [{"path": str(shared / "data" / "train" / "gsm8k_train.jsonl"), "max_rows": 3}],
                    "self_prompts": {"count": 12, "max_tokens": 96, "temperature": 1.0, "seed": 3,
                                                     "batch_size": 12}},
    }
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    ctx = RunContext(cfg=load_config(p), log=lambda m: None)
    s = run_stage(ctx, "prepare")
    report = json.loads(ctx.run.prepare_report.read_text())
    src = report["sources"][-1]
    assert src["format"] == "self" and src["rows_read"] == 12
    assert src["rows_kept"] + src["rows_skipped"] == 12 and src["rows_kept"] >= 1, src
    rows = [json.loads(x) for x in ctx.run.prepared.read_text().splitlines()]
    mine = [r for r in rows if r["source"].startswith("self-prompts:")]
    assert len(mine) == src["rows_kept"] and s.samples == 3 + src["rows_kept"]
    assert all([m["role"] for m in r["messages"]] == ["user"] and r["messages"][0]["content"].strip() for r in mine)
    assert len({r["messages"][0]["content"] for r in mine}) == len(mine)           # no repeats


def test_the_prefix_is_the_template_up_to_a_user_message(stories_dir):
    from transformers import AutoTokenizer

    from eyas.data.chat import render_prompt

    tok = AutoTokenizer.from_pretrained(stories_dir)
    prefix = user_turn_prefix(tok)
    assert render_prompt(tok, [{"role": "user", "content": "Hello there"}]).startswith(prefix + "Hello there")


def test_system_prompts_steer_and_are_counted(tmp_path, stories_dir):
    """prepare.self_prompts.system_prompts: prompt i is sampled after system message i % n; the report counts the
    prompts kept after each (null: the template's default)."""
    import shutil

    target = tmp_path / "target"
    shutil.copytree(stories_dir, target)
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2, 426]}))
    systems = [None, "Once upon a time there was a dog."]
    cfg = {"run_dir": str(tmp_path / "run"), "target": {"model": str(target), "dtype": "float32", "device": "cpu"},
           "prepare": {"sources": [], "self_prompts": {"count": 12, "max_tokens": 96, "seed": 3, "batch_size": 12,
                                                       "system_prompts": systems}}}
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    ctx = RunContext(cfg=load_config(p), log=lambda m: None)
    run_stage(ctx, "prepare")
    src = json.loads(ctx.run.prepare_report.read_text())["sources"][-1]
    by = src["self_prompts"]["kept_by_system_prompt"]
    assert [b["system_prompt"] for b in by] == systems
    assert sum(b["kept"] for b in by) == src["rows_kept"] >= 1, src   # no length or language filter set


def test_the_prefix_after_a_system_message(stories_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_dir)
    steered = user_turn_prefix(tok, system="Tell of dogs.")
    assert steered.startswith(user_turn_prefix(tok)) and "Tell of dogs." in steered
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'system' %}{{ m['content'] }}{% endif %}"
                         "{% endfor %}")   # a template that drops system messages: refused, naming the setting
    with pytest.raises(ValueError, match="system_prompts"):
        user_turn_prefix(tok, system="Tell of dogs.")
