"""Issue 19, item 1: one writer per run folder (eyas.run_lock). A second holder of ``RUN/writer.lock`` is refused
naming the first (pid, host, command, since when); the processes of one torchrun job are one writer, two jobs are
two; a released lock leaves no file (and no run folder a refused command made). Real processes, ``kill -9`` and
torchrun itself: tests/e2e/test_one_writer.py."""

from __future__ import annotations

import os
import socket
import time

import pytest

from eyas.run_folder import RunFolder
from eyas.run_lock import RunFolderBusy, acquire, await_job_holder, hold_run_folder, read_holder, torchrun_job


def _torchrun_env(rank: int, run_id: str = "job-a", port: str = "29611") -> dict[str, str]:
    return {"WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "TORCHELASTIC_RUN_ID": run_id,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "TORCHELASTIC_RESTART_COUNT": "0"}


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    run = RunFolder(tmp_path / "runs" / "r1")
    with hold_run_folder(run, ["/x/bin/eyas", "extract", "my.yaml"]):
        h = read_holder(run)
        assert (h.pid, h.host, h.command, h.job) == (os.getpid(), socket.gethostname(), "eyas extract my.yaml", None)
        assert time.time() - 60 < h.since <= time.time()
        # flock(2) locks are per open file: a second acquisition conflicts even inside one process
        with pytest.raises(RunFolderBusy) as e:
            acquire(run, ["eyas", "train", "my.yaml"])
        msg = str(e.value)
        assert msg.startswith(f"{run.root} is being written by another Eyas command: pid {os.getpid()} on "
                              f"{socket.gethostname()}, `eyas extract my.yaml`, since "
                              f"{time.strftime('%Y-%m-%d', time.localtime(h.since))}"), msg
        assert "wait for that one to end (or stop it), or give this command another run_dir" in msg
        assert "released when that process ends, even if it is killed" in msg
    assert not run.writer_lock.exists()
    # the run folder (and the parent it made) held nothing else: a command that was refused later leaves no trace
    assert not (tmp_path / "runs").exists()
    with hold_run_folder(run, ["eyas", "train", "my.yaml"]):       # free again
        assert read_holder(run).command == "eyas train my.yaml"
        (run.root / "run.json").write_text("{}")
    assert run.root.exists() and not run.writer_lock.exists()     # a folder with work in it stays


def test_torchrun_ranks_of_one_job_are_one_writer_and_two_jobs_are_two(tmp_path):
    run = RunFolder(tmp_path / "run")
    a0, a1, b1 = _torchrun_env(0), _torchrun_env(1), _torchrun_env(1, run_id="job-b", port="29612")
    assert torchrun_job({"WORLD_SIZE": "1", "RANK": "0"}) is None
    assert torchrun_job(a0).key == torchrun_job(a1).key != torchrun_job(b1).key
    with hold_run_folder(run, ["eyas", "extract", "c.yaml"], env=a0):     # job A's rank 0 takes the lock
        h = read_holder(run)
        assert (h.job, h.world) == (torchrun_job(a0).key, 2)
        with hold_run_folder(run, ["eyas", "extract", "c.yaml"], env=a1):  # its rank 1 goes on, holding nothing
            pass
        assert read_holder(run) == h
        with pytest.raises(RunFolderBusy) as e:                           # job B's rank 0 is refused ...
            acquire(run, ["eyas", "extract", "c.yaml"], torchrun_job(_torchrun_env(0, "job-b", "29612")))
        assert f"(rank 0 of torchrun job {torchrun_job(a0).key}, 2 processes)" in str(e.value)
        t0 = time.monotonic()
        with pytest.raises(RunFolderBusy, match=r"rank 1 of torchrun job job-b@127\.0\.0\.1:29612/restart-0 found "
                                                r"the lock held by another process, not by its rank 0\): pid"):
            await_job_holder(run, torchrun_job(b1), other_s=0.3)          # ... and so is every other rank of B
        assert time.monotonic() - t0 < 5
    # a rank whose rank 0 never takes the lock writes nothing either
    with pytest.raises(RunFolderBusy, match="rank 0 did not take .*writer.lock within 0 s, so this rank writes "
                                            "nothing"):
        await_job_holder(run, torchrun_job(a1), wait_s=0.2)


def test_the_cli_takes_the_lock_for_writers_only(tmp_path):
    """Stage commands, `eyas run` and `eyas doctor --repair` are refused while the run is held (before any work:
    nothing is read past the config); `eyas doctor` without --repair and `eyas show-config` are not."""
    from typer.testing import CliRunner

    from eyas.cli import app

    run = RunFolder(tmp_path / "run")
    (run.root / "tokenize").mkdir(parents=True)
    (run.root / "run.json").write_text('{"run_id": "r"}')
    (run.root / "tokenize" / "samples.jsonl").write_text("")
    over = f"run_dir={run.root}"
    with hold_run_folder(run, ["eyas", "train", "my.yaml"]):
        for args in (["prepare", "demo", over], ["train", "demo", over], ["run", "demo", over],
                     ["export", "demo", over], ["doctor", str(run.root), "--repair"]):
            res = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
            out = " ".join(res.output.split())
            assert res.exit_code == 2, (args, out)
            assert f"error: {run.root} is being written by another Eyas command: pid {os.getpid()}" in out, out
            assert "`eyas train my.yaml`" in out
        res = CliRunner().invoke(app, ["doctor", str(run.root)])
        assert res.exit_code == 0, res.output
        assert CliRunner().invoke(app, ["show-config", "demo", over]).exit_code == 0
    assert sorted(p.name for p in run.root.iterdir()) == ["run.json", "tokenize"]
