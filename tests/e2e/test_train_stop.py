"""RUN/train/STOP asked for while the train stage is still loading (before its first step) is honoured, not lost.

The device run of 2026-12-04 touched STOP a few seconds after the stage had started; the stage then removed the file
as stale while it loaded the target and trained its whole schedule past the deadline. Now a STOP present at start
stops training after the first step, the summary says ``stopped_on_request``, and the file is removed only once it
has been honoured, so that the next start trains on.
"""

from __future__ import annotations

import pytest
import yaml

from eyas.config import load_config
from eyas.stages import RunContext, init_run_dir, run_stage


@pytest.mark.e2e
def test_a_stop_made_before_the_first_step_ends_training_after_it(tmp_path, shared):
    stories = shared / "models" / "stories260K"
    cfg = {"run_dir": str(tmp_path / "run"),
           "target": {"model": str(stories / "stories260K.bin"), "tokenizer": str(stories / "tok512.bin")},
           "prepare": {"sources": [{"path": str(shared / "data" / "train" / "gsm8k_train.jsonl"), "max_rows": 12}]},
           "generate": {"enabled": False}, "tokenize": {"max_length": 96}, "vocab": {"draft_vocab_size": 64},
           "extract": {"layer_ids": [1, 2, 3]},
           "train": {"mode": "online", "ttt_steps": 2, "epochs": 2, "batch_size": 2, "eval_samples": 1}}
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    logs: list[str] = []
    ctx = RunContext(cfg=load_config(p), log=logs.append)
    init_run_dir(ctx, ["test"])
    for stage in ("prepare", "generate", "tokenize", "vocab"):
        run_stage(ctx, stage)
    stop = ctx.run.train_stop
    stop.parent.mkdir(parents=True, exist_ok=True)
    stop.touch()   # as bench/mix.py's deadline does while the stage is still loading

    summary = run_stage(ctx, "train")

    assert summary.steps == 1 and summary.stopped_on_request is True
    assert any("a stop asked for before training started" in line for line in logs)
    assert not stop.exists()                       # honoured, so removed
    assert (ctx.run.drafter / "draft.safetensors").exists()   # its drafter written, as at a schedule's end
