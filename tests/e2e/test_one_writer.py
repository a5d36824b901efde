"""Issue 19, item 1: one writer per run folder, with real processes on stories260K.

While an ``eyas`` command writes a run folder, a second command on the same run (``python -m eyas.cli``, as a
retried job or a second terminal would start it) is refused before it writes anything, naming the holder (pid,
host, command, since when) and the run folder, exit code 2; a read-only command (``eyas plan``) still runs; a
``kill -9`` of the holder leaves the run unlocked. Under torchrun the two processes of one job are one writer (the
job finishes), and a second job is refused on every rank before any rank writes.

The holding command is the real CLI with its stage's work replaced by a wait (``_HOLD``), so it holds the lock for as
long as the test needs, whatever this machine's speed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny import stories_extract_config

from eyas.config import load_config
from eyas.stages import RunContext, run_stage
from eyas.store import HiddenStateStore
from eyas.store.doctor import diagnose

pytestmark = pytest.mark.e2e

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "400"}

# `eyas STAGE CONFIG` whose stage, once started (lock taken, fingerprint written), touches a file and waits
_HOLD = """
import sys, time
from pathlib import Path
import eyas.stages
stage, config, started = sys.argv[1:4]
mod = eyas.stages.stage_module(stage)
def wait(ctx):
    Path(started).write_text("started")
    time.sleep(600)
mod.run = wait
sys.argv = ["eyas", stage, config]
from eyas.cli import app
app()
"""


def _config(tmp_path: Path, stories_dir: Path, shared: Path) -> Path:
    return stories_extract_config(tmp_path, stories_dir, shared, rows=16, shard_bytes=30000)


def _hold(stage: str, cfg: Path, tmp_path: Path) -> subprocess.Popen:
    """The real CLI running ``stage`` on ``cfg``, waiting inside the stage (the lock held) until killed."""
    started = tmp_path / f"{stage}.started"
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, stage, str(cfg), str(started)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=ENV)
    deadline = time.time() + 300
    while not started.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    return proc


def _eyas(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eyas.cli", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


def _files(run: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}


def _kill9(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL


def test_a_second_command_is_refused_naming_the_holder_and_kill_9_frees_the_run(tmp_path, stories_dir, shared):
    cfg = _config(tmp_path, stories_dir, shared)
    run = tmp_path / "run"
    holder = _hold("prepare", cfg, tmp_path)
    try:
        before = _files(run)
        second = _eyas("prepare", str(cfg))
        out = " ".join((second.stdout + second.stderr).split())
        assert second.returncode == 2, out
        assert (f"error: {run} is being written by another Eyas command: pid {holder.pid} on "
                f"{socket.gethostname()}, `eyas prepare {cfg}`, since ") in out, out
        assert "Traceback" not in out
        assert "writer.lock" in before and _files(run) == before        # the refused command wrote nothing
        assert not (run / "prepare" / "conversations.jsonl").exists()
        plan = _eyas("plan", str(cfg), "--sample", "4", "--json")        # read-only: not blocked
        assert plan.returncode == 0, plan.stdout + plan.stderr
    finally:
        if holder.poll() is None:
            _kill9(holder)
    assert (run / "writer.lock").exists()                 # left by the killed holder, and locked by no one
    third = _eyas("prepare", str(cfg))
    assert third.returncode == 0, third.stdout + third.stderr
    assert (run / "prepare" / "done.json").exists() and not (run / "writer.lock").exists()


def _torchrun(stage: str, cfg: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "eyas.cli",
                           stage, str(cfg)],
                          capture_output=True, text=True, env=ENV, timeout=900)


def test_torchrun_ranks_are_one_writer_and_a_second_job_is_refused(tmp_path, stories_dir, shared):
    cfg = _config(tmp_path, stories_dir, shared)
    run = tmp_path / "run"
    ctx = RunContext(cfg=load_config(cfg), log=lambda m: None, argv=["test"])
    for s in ("prepare", "generate", "tokenize"):
        run_stage(ctx, s)
    holder = _hold("extract", cfg, tmp_path)          # an `eyas extract` on one process holds the run
    try:
        refused = _torchrun("extract", cfg)
        out = " ".join((refused.stdout + refused.stderr).split())
        assert refused.returncode != 0, out
        assert f"is being written by another Eyas command: pid {holder.pid} on {socket.gethostname()}" in out, out
        assert not (run / "extract" / "store").exists()  # no rank of the refused job wrote
    finally:
        if holder.poll() is None:
            _kill9(holder)
    done = _torchrun("extract", cfg)                  # rank 0 takes the lock; rank 1 is of its job and goes on
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    store = HiddenStateStore.open(run / "extract" / "store")
    assert {p.name for p in (run / "extract" / "store" / "manifest").iterdir()} == {"rank-000.jsonl",
                                                                                     "rank-001.jsonl"}
    assert len(store) == sum(1 for _ in open(run / "tokenize" / "samples.jsonl"))
    assert diagnose(run).clean and not (run / "writer.lock").exists()
