"""Issue 19, item 5: a full disk during extraction is one clear error, not a traceback, and the disk estimate is
what the store really takes (stories260K, the real extract stage).

The disk fills while shards are written (``_FullDisk``: the store's shard files share a fixed number of free
bytes; a write past them writes what fits and raises ``OSError(ENOSPC)``, as write(2) does on a full disk). The
user sees one error naming the store, the samples committed, the bytes still needed and that the same command
resumes; the same command, once space is freed, resumes from the committed samples to a store ``eyas doctor``
finds clean. Before extraction the stage announces the bytes it will write: a store of a few hundred KB is
announced as that, not as one whole ``extract.shard_bytes`` (256 MiB by default) more."""

from __future__ import annotations

import builtins
import errno
import os
import re
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tiny import stories_extract_config

from eyas.cli import app
from eyas.config import load_config
from eyas.plan import human_bytes
from eyas.records import read_tokenized
from eyas.stages import RunContext, run_stage
from eyas.store import HiddenStateStore, shards
from eyas.store.doctor import diagnose
from eyas.store.extraction import bytes_to_store, check_store_space
from eyas.store.header import expected_header

pytestmark = pytest.mark.e2e


def _config(tmp_path: Path, stories_dir: Path, shared: Path, **extract) -> Path:
    return stories_extract_config(tmp_path, stories_dir, shared, rows=20, **extract)


def _tokenized(cfg: Path, logs: list[str] | None = None) -> RunContext:
    ctx = RunContext(cfg=load_config(cfg), log=(logs.append if logs is not None else lambda m: None), argv=["test"])
    for s in ("prepare", "generate", "tokenize"):
        run_stage(ctx, s)
    return ctx


def _on_disk(store: Path) -> int:
    return sum(p.stat().st_size for p in store.rglob("*") if p.is_file())


class _FullDisk:
    """``open`` for :mod:`eyas.store.shards`: files opened for writing share ``free`` bytes (thread-safe: shards
    are committed by two threads); past them a write writes what fits and raises ENOSPC."""

    def __init__(self, free: int):
        self.free = free
        self.lock = threading.Lock()
        self.refused = 0

    def open(self, path, mode="r", *args, **kw):
        f = builtins.open(path, mode, *args, **kw)
        return self._File(self, f) if "w" in mode or "a" in mode else f

    class _File:
        def __init__(self, disk: "_FullDisk", f):
            self.disk, self.f = disk, f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data) -> int:
            data = memoryview(data).cast("B")
            with self.disk.lock:
                n = min(len(data), self.disk.free)
                self.disk.free -= n
            self.f.write(data[:n])
            if n < len(data):
                self.disk.refused += 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return n


def test_a_full_disk_is_one_error_and_the_same_command_resumes(tmp_path, stories_dir, shared, monkeypatch):
    cfg = _config(tmp_path, stories_dir, shared, shard_bytes=60_000, ignore_disk_space=True)
    ctx = _tokenized(cfg)
    samples = read_tokenized(ctx.run.tokenized)
    store_dir = ctx.run.store
    disk = _FullDisk(free=200_000)                   # about three shards of two samples each fit
    monkeypatch.setattr(shards, "open", disk.open, raising=False)
    res = CliRunner().invoke(app, ["extract", str(cfg)], env={"COLUMNS": "400"})
    monkeypatch.undo()
    out = " ".join(res.output.split())
    assert disk.refused >= 1
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), (res.exception, out)
    assert "Traceback" not in out and out.count("error:") == 1, out
    store = HiddenStateStore.open(store_dir)
    committed = len(store)
    assert 0 < committed < len(samples)
    missing = [s for s in samples if s.id not in store]
    need = bytes_to_store(store.header, missing)
    assert (f"error: extract: the disk is full (No space left on device) while writing the hidden-state store "
            f"{store_dir}: {committed} of {len(samples)} samples are committed and kept; the other {len(missing)} "
            f"need about {human_bytes(need)} ({need:,} bytes) more, and the disk holding {store_dir} has ") in out, out
    assert out.endswith("free. Free space (or move run_dir) and run the same command again: it resumes from the "
                        "committed samples."), out
    assert not ctx.run.done("extract").exists()
    before = _on_disk(store_dir)

    res = CliRunner().invoke(app, ["extract", str(cfg)], env={"COLUMNS": "400"})       # space freed: same command
    assert res.exit_code == 0, res.output
    assert f"resuming, {committed} samples already stored and validated" in " ".join(res.output.split())
    assert len(HiddenStateStore.open(store_dir)) == len(samples) and diagnose(ctx.run.root).clean
    added = _on_disk(store_dir) - before
    assert added <= need <= added * 1.05, (added, need)  # "bytes still needed" was what the resume wrote


def test_the_disk_estimate_is_what_the_store_takes(tmp_path, stories_dir, shared):
    logs: list[str] = []
    cfg = _config(tmp_path, stories_dir, shared)     # extract.shard_bytes: the default 256 MiB
    ctx = _tokenized(cfg, logs)
    assert ctx.cfg.extract.shard_bytes == 256 << 20
    header = expected_header(ctx.cfg.target, ctx.cfg.extract, ctx.run)
    need = check_store_space(ctx.cfg.extract, ctx.run, header, read_tokenized(ctx.run.tokenized), logs.append)
    run_stage(ctx, "extract")
    taken = _on_disk(ctx.run.store)
    assert taken < 1 << 20                           # a store well under a megabyte ...
    assert taken * 0.97 <= need <= taken * 1.05, (need, taken)   # ... announced as what it takes
    said = [m for m in logs if m.startswith("[eyas] extract: will write")]
    assert len(said) == 2 and all(m.startswith(f"[eyas] extract: will write {human_bytes(need)} (") for m in said)
    assert re.search(r"\(\d+ samples, [\d,]+ tokens x 516 bytes/token, plus 640 bytes per sample of shard headers "
                     r"and manifest lines\)", said[0]), said[0]
    # what is stored is not counted again
    assert check_store_space(ctx.cfg.extract, ctx.run, header, read_tokenized(ctx.run.tokenized), logs.append) == 0


def test_a_full_disk_in_another_stage_is_one_error_too(tmp_path, stories_dir, shared, monkeypatch):
    """prepare's outputs meet a full disk when they are fsynced (where a full disk shows itself on file systems
    that allocate late): one error naming the stage and the run folder; the same command then finishes."""
    cfg = _config(tmp_path, stories_dir, shared)
    run = tmp_path / "run"
    fsync = os.fsync

    def full_for_prepare(fd: int) -> None:
        if os.path.isfile(f"/proc/self/fd/{fd}") and f"{run}/prepare/" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", full_for_prepare)
    res = CliRunner().invoke(app, ["prepare", str(cfg)], env={"COLUMNS": "400"})
    monkeypatch.undo()
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), (res.exception, out)
    assert out.count("error:") == 1 and "Traceback" not in out, out
    assert (f"error: prepare: the disk is full (OSError: No space left on device) while writing the run folder "
            f"{run}; the disk holding {run} has ") in out, out
    assert out.endswith("free. What was committed is kept: free space (or move run_dir) and run the same command "
                        "again; finished stages are skipped and committed work (generated replies, stored hidden "
                        "states, training checkpoints) is resumed."), out
    assert not (run / "prepare" / "done.json").exists()
    res = CliRunner().invoke(app, ["prepare", str(cfg)])
    assert res.exit_code == 0, res.output
    assert (run / "prepare" / "done.json").exists()
