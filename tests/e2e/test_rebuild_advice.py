"""A refusal that points at a rebuild names the command that works and what it redoes (issue 19 item 7): changing
tokenize.max_length makes generate stale too (it reads that field), so `eyas tokenize --force` would be refused in
turn; the advice names `eyas run --force` from generate, the stages it redoes, and the cheap route."""

from __future__ import annotations

import pytest
import yaml

from eyas.config import load_config
from eyas.errors import EyasError
from eyas.stages import RunContext, init_run_dir, run_stage, run_stages

pytestmark = pytest.mark.e2e


def _ctx(path, overrides=None, force=False):
    ctx = RunContext(cfg=load_config(path, overrides), force=force, log=lambda m: None)
    init_run_dir(ctx, ["test"])
    return ctx


def test_advice_names_the_earliest_stale_stage_and_the_cheap_route(tmp_path, shared):
    stories = shared / "models" / "stories260K"
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"),
        "target": {"model": str(stories / "stories260K.bin"), "tokenizer": str(stories / "tok512.bin")},
        "prepare": {"sources": [{"path": str(shared / "data" / "train" / "gsm8k_train.jsonl"), "max_rows": 4}]},
        "generate": {"max_new_tokens": 16, "batch_size": 4}, "tokenize": {"max_length": 400},
        "vocab": {"draft_vocab_size": 300}}))
    ctx = _ctx(p)
    for s in ("prepare", "generate", "tokenize"):
        run_stage(ctx, s)
    changed = _ctx(p, ["tokenize.max_length=300"])
    with pytest.raises(EyasError) as e:
        run_stage(changed, "vocab")
    msg = str(e.value)
    assert "(tokenize.max_length: 400 -> 300)" in msg
    assert "generate reads that setting too" in msg
    assert "`eyas run CONFIG --force` redoes 2 stages (generate, tokenize)" in msg
    assert "set train.max_length instead" in msg
    # the advice works: run --force redoes generate and tokenize and keeps prepare
    prepared = (tmp_path / "run" / "prepare" / "done.json").stat().st_mtime_ns
    run_stages(_ctx(p, ["tokenize.max_length=300"], force=True), ["prepare", "generate", "tokenize", "vocab"])
    assert (tmp_path / "run" / "prepare" / "done.json").stat().st_mtime_ns == prepared
    assert (tmp_path / "run" / "vocab" / "done.json").exists()
    # a change only the input itself reads: the advice is that stage's own --force
    with pytest.raises(EyasError, match=r"\(vocab.draft_vocab_size: 300 -> 200\): rebuild it first with `eyas vocab "
                                        r"CONFIG --force` \(it redoes vocab\)"):
        run_stage(_ctx(p, ["tokenize.max_length=300", "vocab.draft_vocab_size=200"]), "train")
