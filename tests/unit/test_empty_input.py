"""Issue 12, kind 2: a stage with nothing to work on stops with an error that names its input, instead of handing
nothing to the next stage (before: prepare exited 0 with 0 conversations and train died with ZeroDivisionError).
The target is stories260K (its tokenizer only: these stages run no model)."""

from __future__ import annotations

from dataclasses import replace

import json

import pytest
import yaml

from eyas.config import SourceConfig, load_config
from eyas.data.formats import load_source
from eyas.errors import DataError
from eyas.records import SkipCounter
from eyas.stages import RunContext, init_run_dir, run_stage


def _ctx(tmp_path, stories_dir, sources, logs, **sections):
    cfg = {"run_dir": str(tmp_path / "run"), "target": {"model": str(stories_dir)},
           "prepare": {"sources": [{"path": str(p)} for p in sources]}, "generate": {"enabled": False},
           "vocab": {"draft_vocab_size": 300}}
    for k, v in sections.items():
        cfg.setdefault(k, {}).update(v)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ctx = RunContext(cfg=load_config(path), log=logs.append)
    init_run_dir(ctx, ["test"])
    return ctx


def _gsm8k(shared, tmp_path, n=4):
    p = tmp_path / "gsm8k.jsonl"
    p.write_text("".join((shared / "data" / "train" / "gsm8k_train.jsonl").open().readlines()[:n]))
    return p


def test_empty_source_stops_prepare_naming_it(tmp_path, stories_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=r"(?s)no conversation to train on.*empty\.jsonl: 0 rows read"):
        run_stage(_ctx(tmp_path, stories_dir, [empty], []), "prepare")
    assert not (tmp_path / "run" / "prepare" / "done.json").exists()


def test_rows_of_unknown_layout_stop_prepare_with_each_sources_counts(tmp_path, stories_dir):
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"question_text": "Hi?", "reply": "Hello."}\n{"foo": 1}\n{"bar": [2]}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError) as e:
        run_stage(_ctx(tmp_path, stories_dir, [odd, empty], []), "prepare")
    msg = str(e.value)
    assert f"{odd}: 3 rows read, 0 kept, 3 skipped (3 x cannot tell the format" in msg
    assert f"{empty}: 0 rows read" in msg


def test_a_source_that_yields_nothing_is_reported(tmp_path, stories_dir, shared):
    good, empty = _gsm8k(shared, tmp_path), tmp_path / "empty.jsonl"
    empty.write_text("")
    logs: list[str] = []
    s = run_stage(_ctx(tmp_path, stories_dir, [good, empty], logs), "prepare")
    assert s.samples == 4
    report = json.loads((tmp_path / "run" / "prepare" / "report.json").read_text())
    assert report["empty_sources"] == [str(empty)]
    assert any("warning: source yielded no conversation" in m and str(empty) in m for m in logs), logs


def test_openai_turns_under_conversations_are_read(tmp_path):
    # A common Hub layout: ShareGPT's `conversations` field holding OpenAI `{"role", "content"}` turns, content
    # as a string or as text parts.
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps({"conversations": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]},
        {"role": "assistant", "content": "Blue."}]}) + "\n" + json.dumps({"conversations": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}) + "\n")
    skips, stats = SkipCounter(), {}
    convs = list(load_source(SourceConfig(path=str(p)), skips, stats))
    assert [(m.role, m.content) for m in convs[0].messages] == [
        ("system", "Be brief."), ("user", "Name a colour."), ("assistant", "Blue.")]
    assert stats["rows_kept"] == 1 and stats["rows_skipped"] == 1
    assert any("only 'text' parts" in r for r in skips.counts)   # an image part is a counted skip, not a crash


def test_no_assistant_turn_with_generation_off_stops_generate(tmp_path, stories_dir):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Once upon a time"}\n{"prompt": "The cat"}\n')
    ctx = _ctx(tmp_path, stories_dir, [prompts], [])
    run_stage(ctx, "prepare")
    with pytest.raises(DataError, match="none of the 2 prepared conversations has an assistant turn"):
        run_stage(ctx, "generate")


def test_tokenize_that_keeps_nothing_stops_with_the_reasons(tmp_path, stories_dir, shared):
    # Every GSM8K question is longer than 8 tokens: no assistant token survives tokenize.max_length.
    ctx = _ctx(tmp_path, stories_dir, [_gsm8k(shared, tmp_path)], [], tokenize={"max_length": 8})
    run_stage(ctx, "prepare")
    run_stage(ctx, "generate")
    with pytest.raises(DataError, match=r"(?s)none of the 4 conversations.*4 x no assistant token within max_length"):
        run_stage(ctx, "tokenize")


@pytest.mark.parametrize("emptied, stage", [("prepare/conversations.jsonl", "generate"),
                                            ("generate/conversations.jsonl", "tokenize"),
                                            ("tokenize/samples.jsonl", "vocab"),
                                            ("tokenize/samples.jsonl", "extract")])
def test_later_stages_refuse_an_empty_input(tmp_path, stories_dir, shared, emptied, stage):
    ctx = _ctx(tmp_path, stories_dir, [_gsm8k(shared, tmp_path)], [])
    for s in ("prepare", "generate", "tokenize"):
        run_stage(ctx, s)
    (tmp_path / "run" / emptied).write_text("")
    ctx = replace(ctx, force=True, redo=frozenset({stage}))   # redo `stage` on its emptied input
    with pytest.raises(DataError, match="holds no|no assistant"):
        run_stage(ctx, stage)
