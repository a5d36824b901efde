"""generate.max_prompt_tokens: turns whose prompt reaches the limit are not generated (stories260K, real model)."""

from __future__ import annotations

import json

import pytest

from eyas.config import load_config
from eyas.stages import RunContext, init_run_dir, run_stage

pytestmark = pytest.mark.e2e


def _config(tmp_path, stories_dir, limit):
    rows = [
        # two turns: the second prompt (first turn + reply + second turn) is over the limit
        {"id": "two", "conversations": [{"from": "human", "value": "Once upon a time"},
                                        {"from": "gpt", "value": "x"},
                                        {"from": "human", "value": "Tom went to the park " * 8}]},
        # one turn already over the limit: nothing is generated, tokenize would skip it
        {"id": "long", "conversations": [{"from": "human", "value": "Lily had a big red ball " * 20}]},
        {"id": "short", "conversations": [{"from": "human", "value": "A cat sat"}]},
    ]
    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_dir: {tmp_path / 'run'}\n"
        f"target: {{model: {stories_dir}, dtype: float32, device: cpu}}\n"
        f"prepare: {{sources: [{{path: {data}, format: sharegpt}}]}}\n"
        f"generate: {{max_new_tokens: 12, batch_size: 3, max_prompt_tokens: {limit}}}\n"
    )
    return load_config(cfg)


def test_turns_over_the_prompt_limit_are_not_generated(tmp_path, stories_dir):
    from transformers import AutoTokenizer

    from eyas.data.chat import render_prompt

    tok = AutoTokenizer.from_pretrained(stories_dir)
    first = render_prompt(tok, [{"role": "user", "content": "Once upon a time"}])
    long = render_prompt(tok, [{"role": "user", "content": "Lily had a big red ball " * 20}])
    n_first = len(tok(first, add_special_tokens=False).input_ids)
    n_long = len(tok(long, add_special_tokens=False).input_ids)
    limit = n_first + 20  # first turn fits; the second turn (+ 12-token reply + 40-token prompt) cannot
    assert n_long >= limit
    ctx = RunContext(cfg=_config(tmp_path, stories_dir, limit), log=lambda m: None)
    init_run_dir(ctx, [])
    run_stage(ctx, "prepare")
    run_stage(ctx, "generate")
    out = {json.loads(x)["id"]: json.loads(x) for x in
           (ctx.run.generated).read_text().splitlines()}
    report = json.loads((ctx.run.generate_report).read_text())
    by_source = {c["source"].rsplit(":", 1)[-1]: c for c in out.values()}
    roles = {k: [m["role"] for m in c["messages"]] for k, c in by_source.items()}
    assert roles == {"1": ["user", "assistant"], "2": ["user"], "3": ["user", "assistant"]}
    assert report["turns_over_max_prompt_tokens_this_run"] == 2
