"""RUN/train/STOP asked for while the train stage is still loading (before its first step) is honoured, not lost.

The device run of 2026-12-04 touched STOP a few seconds after the stage had started; the stage then removed the file
as stale while it loaded the target and trained its whole schedule past the deadline. Now a STOP present at start
stops training after the first step, the summary says ``stopped_on_request``, and the file is removed only once it
has been honoured, so that the next start trains on.
"""

from __future__ import annotations

import pytest
from tiny import stories_train_run

from eyas.stages import run_stage


@pytest.mark.e2e
def test_a_stop_made_before_the_first_step_ends_training_after_it(tmp_path, shared):
    ctx, logs = stories_train_run(tmp_path, shared, rows=12, epochs=2, batch_size=2, eval_samples=1)
    stop = ctx.run.train_stop
    stop.parent.mkdir(parents=True, exist_ok=True)
    stop.touch()   # as bench/mix.py's deadline does while the stage is still loading

    summary = run_stage(ctx, "train")

    assert summary.steps == 1 and summary.stopped_on_request is True
    assert any("a stop asked for before training started" in line for line in logs)
    assert not stop.exists()                       # honoured, so removed
    assert (ctx.run.drafter / "draft.safetensors").exists()   # its drafter written, as at a schedule's end
