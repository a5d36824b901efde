"""The train stage on the real stories260K target: offline (from the store) equals online (the target in the
training job, nothing stored) on the same data and seed; ``--init-from`` fine-tunes an Eyas or SGLang drafter and
keeps its draft vocabulary, or moves it onto the run's (``train.init_vocab: run``)."""

from __future__ import annotations

import json

import pytest
import yaml
from safetensors.torch import load_file

from eyas.config import load_config
from eyas.errors import EyasError
from eyas.stages import RunContext, init_run_dir, run_stage

pytestmark = pytest.mark.e2e


def _config(tmp_path, shared, name: str, draft_vocab_size: int = 200, **train):
    stories = shared / "models" / "stories260K"
    cfg = {
        "run_dir": str(tmp_path / name),
        "target": {"model": str(stories / "stories260K.bin"), "tokenizer": str(stories / "tok512.bin")},
        "prepare": {"sources": [{"path": str(shared / "data" / "train" / "gsm8k_train.jsonl"), "max_rows": 12}]},
        "generate": {"enabled": False},          # the dataset's own answers: no generation needed here
        "tokenize": {"max_length": 160},
        "vocab": {"draft_vocab_size": draft_vocab_size},
        "extract": {"layer_ids": [1, 2, 3], "dtype": "float32"},
        "train": {"ttt_steps": 3, "epochs": 2, "lr": 3e-3, "batch_size": 3, "checkpoint_every": 100,
                  "eval_samples": 2, "eval_every": 3, **train},
    }
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _run(path, stages, overrides=None):
    ctx = RunContext(cfg=load_config(path, overrides), log=lambda m: None)
    init_run_dir(ctx, ["test"])
    return {s: run_stage(ctx, s) for s in stages}


def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]


def test_offline_equals_online_and_init_from(tmp_path, shared):
    off = _run(_config(tmp_path, shared, "off"), ["prepare", "generate", "tokenize", "vocab", "extract", "train"])
    on = _run(_config(tmp_path, shared, "on", mode="online"), ["prepare", "generate", "tokenize", "vocab", "train"])
    assert not (tmp_path / "on" / "extract").exists()          # nothing stored
    a, b = _rows(tmp_path / "off"), _rows(tmp_path / "on")
    assert len(a) == len(b) == off["train"].steps > 2
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5, abs=1e-6)
        assert [rb[f"count_{k}"] for k in range(3)] == [ra[f"count_{k}"] for k in range(3)]
    assert b[-1]["eval_loss"] == pytest.approx(a[-1]["eval_loss"], rel=1e-5)
    assert on["train"].mode == "online" and off["train"].loss < off["train"].first_loss

    # fine-tune the trained drafter (Eyas format) in a run whose own vocabulary differs: the drafter's d2t stays
    final = tmp_path / "off" / "train" / "final"
    d2t = load_file(str(final / "draft.safetensors"))["d2t"]
    ft = _run(_config(tmp_path, shared, "ft", 150, epochs=1), ["prepare", "generate", "tokenize", "vocab", "extract"])
    assert ft["vocab"].draft_vocab_size == 150
    s = _run(_config(tmp_path, shared, "ft", 150, epochs=1, init_from=str(final)), ["train"])
    got = load_file(str(tmp_path / "ft" / "train" / "final" / "draft.safetensors"))
    assert got["d2t"].shape == (200,) and (got["d2t"] == d2t).all()
    # it starts from the trained drafter: its first loss is near where the first run ended, far under a fresh one
    assert s["train"].first_loss < 0.5 * (off["train"].first_loss + off["train"].loss)

    # train.init_vocab=run: the same drafter moved onto a run's larger vocabulary (its 200 ids kept, 100 new): it
    # trains over the run's d2t and still starts from what it knows
    v = _run(_config(tmp_path, shared, "ftv", 300, epochs=1, init_from=str(final), init_vocab="run"),
             ["prepare", "generate", "tokenize", "vocab", "extract", "train"])
    moved = load_file(str(tmp_path / "ftv" / "train" / "final" / "draft.safetensors"))
    run_d2t = load_file(str(tmp_path / "ftv" / "vocab" / "vocab.safetensors"))["d2t"]
    assert moved["d2t"].shape == (300,) and (moved["d2t"] == run_d2t).all()
    assert moved["lm_head.weight"].shape[0] == 300
    assert v["train"].first_loss < 0.5 * (off["train"].first_loss + off["train"].loss)

    # a wider drafter grown from it: train.draft.intermediate_size widens the MLP, which starts out computing what
    # the trained drafter computes (the same first loss as the fine-tune above, on the same batch) and is kept wide
    inter = got["midlayer.mlp.gate_proj.weight"].shape[0]
    wide_cfg = _config(tmp_path, shared, "ftw", 150, epochs=1, init_from=str(final),
                       draft={"intermediate_size": 3 * inter})
    w = _run(wide_cfg, ["prepare", "generate", "tokenize", "vocab", "extract", "train"])
    wide = load_file(str(tmp_path / "ftw" / "train" / "final" / "draft.safetensors"))
    assert wide["midlayer.mlp.gate_proj.weight"].shape[0] == 3 * inter and (wide["d2t"] == d2t).all()
    assert w["train"].first_loss == pytest.approx(s["train"].first_loss, rel=1e-4)
    # any other shape change of a drafter is refused, naming the field
    with pytest.raises(EyasError, match=r"train\.draft\.num_attention_heads: 2 asked, the drafter has"):
        _run(_config(tmp_path, shared, "fth", 150, epochs=1, init_from=str(final), draft={"num_attention_heads": 2}),
             ["prepare", "generate", "tokenize", "vocab", "extract", "train"])

    # the SGLang-format export of the same drafter loads too
    _run(_config(tmp_path, shared, "off"), ["export"])
    sg = tmp_path / "off" / "export" / "sglang"
    _run(_config(tmp_path, shared, "ft2", 150, epochs=1, init_from=str(sg)),
         ["prepare", "generate", "tokenize", "vocab", "extract", "train"])
    got2 = load_file(str(tmp_path / "ft2" / "train" / "final" / "draft.safetensors"))
    assert (got2["d2t"] == d2t).all()


def _stage_worker(rank: int, world: int, port: int, cfg_path: str):
    import os

    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    _run(cfg_path, ["train"], ["train.batch_size=2", "train.distributed=fsdp"])
    import torch.distributed as dist

    dist.destroy_process_group()


def test_train_stage_under_two_processes(tmp_path, shared):
    """What `torchrun --nproc-per-node 2 -m eyas.cli train CONFIG` does, on CPU (gloo): both processes run the
    stage; process 0 writes; the summary and the trajectory equal one process with the same global batch."""
    import socket

    import torch.multiprocessing as mp

    stages = ["prepare", "generate", "tokenize", "vocab", "extract"]
    one = _run(_config(tmp_path, shared, "one", batch_size=4), stages + ["train"])
    cfg2 = _config(tmp_path, shared, "two", batch_size=4)
    _run(cfg2, stages)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_stage_worker, args=(2, port, str(cfg2)), nprocs=2, join=True, start_method="fork")
    done = json.loads((tmp_path / "two" / "train" / "done.json").read_text())["summary"]
    assert done["steps"] == one["train"].steps and done["loss"] == pytest.approx(one["train"].loss, rel=1e-5)
    a, b = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-5)
    w1 = load_file(str(tmp_path / "one" / "train" / "final" / "draft.safetensors"))
    w2 = load_file(str(tmp_path / "two" / "train" / "final" / "draft.safetensors"))
    assert set(w1) == set(w2)
    for k in w1:
        assert (w1[k].float() - w2[k].float()).abs().max() < 1e-4, k


def test_eyas_run_online_skips_extract(tmp_path, shared):
    """``eyas run`` under ``train.mode: online`` never runs the extract stage (nothing stored) and its summary says
    so, with the drafter's tokens per target step beside n-gram lookup's."""
    from typer.testing import CliRunner

    from eyas.cli import app

    p = _config(tmp_path, shared, "run", mode="online", epochs=1)
    # no evaluation prompts: refused before the first stage, not after training
    res = CliRunner().invoke(app, ["run", str(p)])
    assert res.exit_code == 2 and "evaluate.prompts and evaluate.benchmarks are empty" in res.output
    assert not (tmp_path / "run").exists()
    held_out = str(shared / "data" / "eval" / "mt_bench.jsonl")
    res = CliRunner().invoke(app, ["run", str(p), f"evaluate.prompts=[{{path: {held_out}, format: mt_bench}}]",
                                   "evaluate.max_prompts=2", "evaluate.max_new_tokens=16", "export.formats=[sglang]"],
                             env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    run = tmp_path / "run"
    assert not (run / "extract").exists() and (run / "export" / "sglang" / "config.json").exists()
    assert "none stored (train.mode online" in res.output
    assert "drafter vs n-gram lookup" in res.output
