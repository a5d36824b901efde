"""The whole pipeline on the real stories260K model: every stage, a skipped re-run, resume of generate, and the
lossless check of the reference speculative decoder."""

from __future__ import annotations

import json

import pytest
import yaml

from eyas.config import load_config
from eyas.errors import EyasError
from eyas.stages import STAGES, RunContext, init_run_dir, run_stage

pytestmark = pytest.mark.e2e


def _config(tmp_path, shared, **over):
    stories = shared / "models" / "stories260K"
    cfg = {
        "run_dir": str(tmp_path / "run"),
        "target": {"model": str(stories / "stories260K.bin"), "tokenizer": str(stories / "tok512.bin")},
        # GSM8K questions: real prompts short enough for stories260K's 512-token context.
        "prepare": {"sources": [{"path": str(shared / "data" / "train" / "gsm8k_train.jsonl"), "max_rows": 24}]},
        "generate": {"max_new_tokens": 40, "batch_size": 12},
        "tokenize": {"max_length": 400},
        "vocab": {"draft_vocab_size": 300},
        "extract": {"layer_ids": [1, 2, 3], "shard_bytes": 20000},
        "train": {"ttt_steps": 3, "epochs": 3, "lr": 3e-3, "batch_size": 4, "checkpoint_every": 5},
        "evaluate": {"prompts": [{"path": str(shared / "data" / "eval" / "gsm8k_test.jsonl")}], "max_prompts": 6,
                     "max_new_tokens": 40},
    }
    for k, v in over.items():
        cfg[k].update(v)
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _ctx(path, logs, overrides=None, force=False):
    ctx = RunContext(cfg=load_config(path, overrides), force=force, log=logs.append)
    init_run_dir(ctx, ["test"])
    return ctx


def test_every_stage_on_stories260k(tmp_path, shared):
    logs: list[str] = []
    ctx = _ctx(_config(tmp_path, shared), logs)
    s = {stage: run_stage(ctx, stage) for stage in STAGES}
    run = tmp_path / "run"
    assert s["prepare"].samples == 24
    assert s["tokenize"].samples == 24 and s["tokenize"].assistant_tokens > 0
    assert s["extract"].layer_ids == [1, 2, 3] and s["extract"].samples == 24
    assert len(list((run / "extract" / "store" / "shards").iterdir())) > 1  # several shards were committed
    assert s["train"].loss < s["train"].first_loss  # it learns
    ev = json.loads((run / "evaluate" / "results.json").read_text())
    assert ev["lossless_mismatches"] == 0 and ev["prompts"] == 6
    assert ev["acceptance_length"] >= 1.0
    assert (run / "export" / "sglang" / "config.json").exists()
    for f in ("config.yaml", "environment.json", "run.json"):
        assert (run / f).exists()

    # A second run skips every stage.
    logs.clear()
    ctx2 = _ctx(_config(tmp_path, shared), logs)
    for stage in STAGES:
        run_stage(ctx2, stage)
    assert sum("already done" in m for m in logs) == len(STAGES)

    # A changed setting is refused for the stages it affects, with the section named.
    ctx3 = _ctx(_config(tmp_path, shared), logs, overrides=["train.lr=1e-3"])
    run_stage(ctx3, "extract")  # extract does not depend on train: still skipped
    with pytest.raises(EyasError, match=r"train.lr: 0.003 -> 0.001"):
        run_stage(ctx3, "train")


def test_generate_resumes_after_interruption(tmp_path, shared):
    logs: list[str] = []
    cfg = _config(tmp_path, shared)
    ctx = _ctx(cfg, logs)
    run_stage(ctx, "prepare")
    run_stage(ctx, "generate")
    out = tmp_path / "run" / "generate" / "conversations.jsonl"
    full = out.read_text().splitlines()
    # Simulate a crash after 10 conversations, with a torn last line, and no done marker.
    out.write_text("\n".join(full[:10]) + "\n" + full[10][: len(full[10]) // 2])
    (tmp_path / "run" / "generate" / "done.json").unlink()
    logs.clear()
    ctx = _ctx(cfg, logs)
    run_stage(ctx, "generate")
    assert any("resuming, 10 of 24" in m for m in logs)
    again = out.read_text().splitlines()
    ids = [json.loads(x)["id"] for x in again]
    assert len(ids) == len(set(ids)) == 24  # no duplicates, nothing lost
    assert sorted(ids) == sorted(json.loads(x)["id"] for x in full)
    assert again[:10] == full[:10]  # finished work untouched
