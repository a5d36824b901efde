"""Issue 12, kind 3, at the tokenize stage: a reply whose text does not re-tokenize to its own tokens inside the
rendering is skipped and counted with its reason, never trained silently changed (stories260K's real tokenizer and
template: a SentencePiece BPE whose merges can join a reply's first letters to the prompt's last ones)."""

from __future__ import annotations

import json

import yaml

from eyas.config import load_config
from eyas.stages import RunContext, init_run_dir, run_stage


def test_replies_the_template_changes_are_skipped_and_counted(tmp_path, stories_dir):
    rows = [
        ("Lily went home.", " She was sad."),            # kept: its tokens are its own
        ("Once upon a ti", "me, there was a cat."),       # "ti" + "me" is tokenized "▁time": the reply's first token
        ("Tell a story.", "The end.</s>Then more."),     # EOS text inside a reply: rendered as the EOS token
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": u},
                                                     {"role": "assistant", "content": a}]}) + "\n" for u, a in rows))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), "target": {"model": str(stories_dir)},
                                   "prepare": {"sources": [{"path": str(data)}]}, "generate": {"enabled": False}}))
    ctx = RunContext(cfg=load_config(cfg), log=lambda m: None)
    init_run_dir(ctx, ["test"])
    for stage in ("prepare", "generate"):
        run_stage(ctx, stage)
    s = run_stage(ctx, "tokenize")
    assert s.samples == 1 and s.skipped == 2
    meta = json.loads((tmp_path / "run" / "tokenize" / "meta.json").read_text())
    assert meta["skips"]["by_reason"] == {
        "reply changed by the chat template: a token crosses the reply's text and the template's around it": 1,
        "reply changed by the chat template: reply holds end-of-turn token text '</s>'": 1,
    }
    assert {e["where"].rsplit(":", 1)[1] for v in meta["skips"]["examples"].values() for e in v} == {"2", "3"}


def test_tokenize_workers_give_the_same_samples(tmp_path, stories_dir, shared):
    """tokenize.workers: a pool of processes writes the same samples, in the same order, with the same counts, as
    one process (real GSM8K rows, stories260K's tokenizer)."""
    src = shared / "data" / "train" / "gsm8k_train.jsonl"
    outs = []
    for workers in (1, 2):
        cfg = tmp_path / f"cfg{workers}.yaml"
        cfg.write_text(yaml.safe_dump({
            "run_dir": str(tmp_path / f"run{workers}"), "target": {"model": str(stories_dir)},
            "prepare": {"sources": [{"path": str(src), "max_rows": 40}]}, "generate": {"enabled": False},
            "tokenize": {"max_length": 160, "workers": workers}}))
        ctx = RunContext(cfg=load_config(cfg), log=lambda m: None)
        init_run_dir(ctx, ["test"])
        for stage in ("prepare", "generate"):
            run_stage(ctx, stage)
        s = run_stage(ctx, "tokenize")
        meta = json.loads(ctx.run.tokenize_meta.read_text())
        meta.pop("target_path")
        outs.append((ctx.run.tokenized.read_bytes(), meta, s.samples, s.truncated, s.skipped))
    # at 160 tokens some samples are cut and some prompts leave no reply token (skipped): those paths compared too
    assert outs[0][2] >= 10 and outs[0][3] > 0 and outs[0][4] > 0, outs[0][2:]
    assert outs[0] == outs[1]
