"""generate.reuse_from: a re-mixed run takes the replies another run generated with the same target and generate
settings (same sample ids), generates only what is new, and refuses a run made with other settings."""

from __future__ import annotations

import json

import pytest
import yaml

from eyas.config import load_config
from eyas.errors import DataError
from eyas.stages import RunContext, init_run_dir, run_stage

pytestmark = pytest.mark.e2e


def _cfg(tmp_path, shared, name, rows, **generate):
    stories = shared / "models" / "stories260K"
    cfg = {"run_dir": str(tmp_path / name),
           "target": {"model": str(stories / "stories260K.bin"), "tokenizer": str(stories / "tok512.bin")},
           "prepare": {"sources": [{"path": str(shared / "data" / "train" / "gsm8k_train.jsonl"), "max_rows": rows}]},
           "generate": {"max_new_tokens": 24, "batch_size": 8, **generate}, "tokenize": {"max_length": 400}}
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _run(path, stages):
    ctx = RunContext(cfg=load_config(path), log=lambda m: None)
    init_run_dir(ctx, ["test"])
    return [run_stage(ctx, s) for s in stages]


def _lines(path):
    return {d["id"]: d for d in map(json.loads, path.read_text().splitlines())}


def test_reuse_takes_finished_replies_and_generates_the_rest(tmp_path, shared):
    _run(_cfg(tmp_path, shared, "big", 10), ["prepare", "generate"])
    big = _lines(tmp_path / "big" / "generate" / "conversations.jsonl")
    # a new mix: the 10 conversations the big run has and 4 it does not (rows 11-14 of the file)
    p = _cfg(tmp_path, shared, "mix", 14, reuse_from=[str(tmp_path / "big")])
    _run(p, ["prepare", "generate"])
    report = json.loads((tmp_path / "mix" / "generate" / "report.json").read_text())
    mix = _lines(tmp_path / "mix" / "generate" / "conversations.jsonl")
    assert report["reused_this_run"] == 10 and len(mix) == 14
    assert report["new_tokens_this_run"] > 0                       # the 4 new ones were generated
    for i, d in big.items():
        assert mix[i] == d                                          # replies and emitted ids as the big run wrote
    # the same replies as a run that generated everything itself (greedy, same settings)
    _run(_cfg(tmp_path, shared, "alone", 14), ["prepare", "generate"])
    alone = _lines(tmp_path / "alone" / "generate" / "conversations.jsonl")
    assert {i: d["messages"] for i, d in alone.items()} == {i: d["messages"] for i, d in mix.items()}


def test_reuse_refuses_a_run_with_other_settings(tmp_path, shared):
    _run(_cfg(tmp_path, shared, "big", 4), ["prepare", "generate"])
    p = _cfg(tmp_path, shared, "other", 4, reuse_from=[str(tmp_path / "big")], max_new_tokens=12)
    with pytest.raises(DataError, match=r"generate.max_new_tokens: 24 -> 12"):
        _run(p, ["prepare", "generate"])
    p = _cfg(tmp_path, shared, "none", 4, reuse_from=[str(tmp_path / "missing")])
    with pytest.raises(DataError, match="no finished generate stage"):
        _run(p, ["prepare", "generate"])
