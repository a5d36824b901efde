"""A stage's fingerprint covers every config field the stage reads.

Every stage runs on the real stories260K pipeline with its config wrapped in a recorder; any field it reads (itself
or through the library functions it hands a section to) outside its declared ``READS`` fails the test: such a
field could change while the stage is skipped as "already done", and the stale output be used downstream. The
generate stage reading ``tokenize.chat_template_kwargs`` without declaring it was such a bug (issue 14): its own test
is below.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml
from pydantic import BaseModel

from eyas.config import load_config
from eyas.errors import EyasError
from eyas.stages import STAGES, RunContext, init_run_dir, run_stage, stage_module

pytestmark = pytest.mark.e2e

# where outputs go does not change them
EXEMPT = {"run_dir"}


class Recorder:
    """A read-only view of a config (section) that records the dotted path of every field read through it. Reading a
    section as a whole (``model_dump``, ``model_copy``, ...) records the section."""

    def __init__(self, obj: BaseModel, reads: set[str], prefix: str = ""):
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_reads", reads)
        object.__setattr__(self, "_prefix", prefix)

    def __getattr__(self, name: str):
        obj, reads, prefix = self._obj, self._reads, self._prefix
        if name in type(obj).model_fields:
            path = f"{prefix}.{name}" if prefix else name
            value = getattr(obj, name)
            if isinstance(value, BaseModel):
                return Recorder(value, reads, path)
            reads.add(path)
            return value
        reads.add(prefix or "*")  # a method or attribute of the whole section
        return getattr(obj, name)

    def __setattr__(self, name, value):
        raise AttributeError(f"a stage assigned {self._prefix}.{name}: configs are read-only to stages")


def _covered(path: str, declared: tuple[str, ...]) -> bool:
    return path in EXEMPT or any(path == d or path.startswith(d + ".") for d in declared)


@pytest.fixture
def recorded(monkeypatch):
    """stage -> the config fields its ``run`` read, for every stage run while the fixture is active."""
    reads: dict[str, set[str]] = {}
    for stage in STAGES:
        module = stage_module(stage)

        def wrapped(ctx, _run=module.run, _stage=stage):
            seen = reads.setdefault(_stage, set())
            return _run(replace(ctx, cfg=Recorder(ctx.cfg, seen)))

        monkeypatch.setattr(module, "run", wrapped)
    return reads


def _config(tmp_path, shared, name="run", **over) -> RunContext:
    stories = shared / "models" / "stories260K"
    cfg = {
        "run_dir": str(tmp_path / name),
        "target": {"model": str(stories / "stories260K.bin"), "tokenizer": str(stories / "tok512.bin")},
        "prepare": {"sources": [{"path": str(shared / "data" / "train" / "gsm8k_train.jsonl"), "max_rows": 8}]},
        "generate": {"max_new_tokens": 16, "batch_size": 8},
        "tokenize": {"max_length": 400},
        "vocab": {"draft_vocab_size": 200},
        "extract": {"layer_ids": [1, 2, 3]},
        "train": {"ttt_steps": 2, "epochs": 1, "batch_size": 4, "eval_samples": 2, "eval_every": 1},
        "export": {"formats": ["sglang", "vllm"]},
        "evaluate": {"prompts": [{"path": str(shared / "data" / "eval" / "gsm8k_test.jsonl")}], "max_prompts": 2,
                     "max_new_tokens": 8},
    }
    for k, v in over.items():
        cfg[k].update(v)
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    ctx = RunContext(cfg=load_config(p), log=lambda m: None)
    init_run_dir(ctx, ["test"])
    return ctx


def _check(reads: dict[str, set[str]]) -> None:
    undeclared = {stage: sorted(p for p in paths if not _covered(p, stage_module(stage).READS))
                  for stage, paths in reads.items()}
    assert not any(undeclared.values()), f"config fields read but not in the stage's READS: {undeclared}"


def test_every_stage_reads_only_what_its_fingerprint_covers(tmp_path, shared, recorded):
    ctx = _config(tmp_path, shared)
    for stage in STAGES:
        run_stage(ctx, stage)
    assert set(recorded) == set(STAGES)
    assert "tokenize.chat_template_kwargs" in recorded["generate"]   # the recorder sees through library calls
    assert "extract.batch_tokens" in recorded["extract"] and "train.ttt_decay" in recorded["train"]
    _check(recorded)


def test_other_paths_read_only_what_they_declare(tmp_path, shared, recorded):
    """Generation off, online training fine-tuning a drafter, the vLLM export only, benchmark sets."""
    base = _config(tmp_path, shared, "base")
    for stage in STAGES[:6]:
        run_stage(base, stage)
    recorded.clear()
    ev = shared / "data" / "eval"
    ctx = _config(tmp_path, shared, "other", generate={"enabled": False},
                  train={"mode": "online", "init_from": str(base.run.drafter)}, export={"formats": ["vllm"]},
                  evaluate={"prompts": [], "benchmarks": [{"name": "mt", "path": str(ev / "mt_bench.jsonl"),
                                                           "max_prompts": 1}]})
    for stage in STAGES:
        if stage != "extract":   # online: nothing stored
            run_stage(ctx, stage)
    assert "train.init_from" in recorded["train"] and "extract.backend" in recorded["train"]
    _check(recorded)


def test_generate_is_redone_when_the_chat_template_arguments_change(tmp_path, shared):
    """The replies are generated from prompts rendered with tokenize.chat_template_kwargs (Qwen3's enable_thinking
    decides whether a reply starts with a thinking block): changing them must not reuse the old replies."""
    logs: list[str] = []
    ctx = _config(tmp_path, shared)
    ctx.log = logs.append
    run_stage(ctx, "prepare")
    run_stage(ctx, "generate")
    changed = replace(ctx, cfg=ctx.cfg.model_copy(update={"tokenize": ctx.cfg.tokenize.model_copy(
        update={"chat_template_kwargs": {"enable_thinking": False}})}))
    with pytest.raises(EyasError, match=r"tokenize.chat_template_kwargs.enable_thinking: None -> False"):
        run_stage(changed, "generate")
    logs.clear()
    run_stage(replace(changed, force=True), "generate")
    assert "[eyas] generate: starting" in logs and not any("already done" in m for m in logs)
