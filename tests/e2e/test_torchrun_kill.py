"""Real ``torchrun --nproc-per-node 2`` (gloo, CPU) runs of extraction and training on stories260K, with one rank
``kill -9``-ed mid-run: torchrun stops the job, a second torchrun resumes it, and the result equals an
uninterrupted two-process run (the same store; the same weights bit for bit after the same steps). The two-GPU
measurement (issue 15, ``bench/two_gpu.sh``) runs the same commands with NCCL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from eyas.config import load_config
from eyas.stages import RunContext, init_run_dir, run_stage
from eyas.store import HiddenStateStore
from eyas.store.doctor import diagnose

pytestmark = pytest.mark.e2e

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _config(root: Path, name: str, shared: Path, stories_dir: Path, **train) -> Path:
    cfg = {
        "run_dir": str(root / name),
        "target": {"model": str(stories_dir), "dtype": "float32", "device": "cpu"},
        "prepare": {"sources": [{"path": str(shared / "data" / "train" / "alpaca_en_demo.json"),
                                 "format": "alpaca", "max_rows": 48}]},
        "generate": {"enabled": False},
        "tokenize": {"max_length": 96},
        "vocab": {"draft_vocab_size": 200},
        "extract": {"layer_ids": [0, 2, 3], "batch_tokens": 200, "shard_bytes": 60000},
        "train": {"ttt_steps": 3, "epochs": 3, "lr": 3e-3, "batch_size": 2, "checkpoint_every": 2,
                  "distributed": "fsdp", "tensorboard": False, **train},
    }
    p = root / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _stages(cfg: Path, stages: list[str]) -> None:
    ctx = RunContext(cfg=load_config(cfg), log=lambda m: None)
    init_run_dir(ctx, ["test"])
    for s in stages:
        run_stage(ctx, s)


BENCH = Path(__file__).resolve().parents[2] / "bench" / "two_gpu.py"


def _torchrun_cmd(stage: str, cfg: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "-m", "eyas.cli", stage, str(cfg)]


def _torchrun(stage: str, cfg: Path) -> subprocess.Popen:
    return subprocess.Popen(_torchrun_cmd(stage, cfg), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=ENV)


def _kill_rank_when(stage: str, cfg: Path, when: Path, tmp_path: Path, lines: int = 0) -> None:
    """``bench/two_gpu.py kill`` (the tool the two-GPU benchmark uses): torchrun ``stage``, ``kill -9`` rank 1
    once ``when`` exists (with ``lines`` complete lines); torchrun must fail."""
    log = tmp_path / f"{stage}_killed.log"
    proc = subprocess.run([sys.executable, str(BENCH), "kill", "--when", str(when), "--lines", str(lines), "--rank",
                           "1", "--log", str(log), "--", *_torchrun_cmd(stage, cfg)],
                          capture_output=True, text=True, env=ENV, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr + (log.read_text()[-3000:] if log.exists() else "")
    assert "killed once" in proc.stdout


def _finish(stage: str, cfg: Path) -> str:
    proc = _torchrun(stage, cfg)
    out = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, out[-4000:]
    return out


def _checksums(run: Path) -> dict[str, str]:
    store = HiddenStateStore.open(run / "extract" / "store")
    assert sum(len(r.samples) for r in store.manifest_records()) == len(store)   # nothing stored twice
    return {sid: store.entry(sid).checksum for sid in store.ids()}


def test_extraction_kill_one_rank_then_resume(tmp_path, shared, stories_dir):
    ref = _config(tmp_path, "ref", shared, stories_dir)
    _stages(ref, ["prepare", "generate", "tokenize", "vocab"])
    _finish("extract", ref)
    ref_sums = _checksums(tmp_path / "ref")
    n_shards = len(HiddenStateStore.open(tmp_path / "ref" / "extract" / "store").manifest_records())
    assert n_shards >= 6

    killed = _config(tmp_path, "killed", shared, stories_dir)
    _stages(killed, ["prepare", "generate", "tokenize", "vocab"])
    manifest = tmp_path / "killed" / "extract" / "store" / "manifest" / "rank-001.jsonl"   # rank 1's first shard
    _kill_rank_when("extract", killed, manifest, tmp_path, lines=1)   # the file exists, empty, before any shard
    assert not (tmp_path / "killed" / "extract" / "done.json").exists()
    partial = len(HiddenStateStore.open(tmp_path / "killed" / "extract" / "store"))
    assert 0 < partial < len(ref_sums)
    _finish("extract", killed)
    assert _checksums(tmp_path / "killed") == ref_sums, f"killed with {partial} of {len(ref_sums)} samples stored"
    assert diagnose(tmp_path / "killed").clean


def test_training_kill_one_rank_then_resume(tmp_path, shared, stories_dir):
    stages = ["prepare", "generate", "tokenize", "vocab", "extract"]
    ref = _config(tmp_path, "ref", shared, stories_dir)
    _stages(ref, stages)
    _finish("train", ref)
    killed = _config(tmp_path, "killed", shared, stories_dir)
    _stages(killed, stages)
    ckpts = tmp_path / "killed" / "train" / "checkpoints"
    _kill_rank_when("train", killed, ckpts / "step-00000004" / "state.json", tmp_path)
    assert not (tmp_path / "killed" / "train" / "done.json").exists()
    out = _finish("train", killed)
    assert "resum" in out.lower(), out[-3000:]
    a = load_file(str(tmp_path / "ref" / "train" / "final" / "draft.safetensors"))
    b = load_file(str(tmp_path / "killed" / "train" / "final" / "draft.safetensors"))
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
