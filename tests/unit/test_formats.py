"""prepare: formats, normalisation rules and bad input, with rows taken from ../shared/data/train."""

import json

import pytest

from eyas.config import SourceConfig
from eyas.data.formats import load_source
from eyas.errors import DataError
from eyas.records import SkipCounter


def _load(path, fmt="auto", max_rows=None):
    skips, stats = SkipCounter(), {}
    convs = list(load_source(SourceConfig(path=str(path), format=fmt, max_rows=max_rows), skips, stats))
    return convs, skips, stats


def _first_row(path, pred):
    rows = json.loads(path.read_text()) if path.suffix == ".json" else [json.loads(x) for x in path.open()]
    return next(r for r in rows if pred(r))


def test_every_training_file_loads_and_counts_add_up(shared):
    for path in sorted((shared / "data" / "train").iterdir()):
        convs, skips, stats = _load(path, max_rows=300)
        assert stats["rows_read"] == stats["rows_kept"] + stats["rows_skipped"], path
        assert stats["rows_kept"] == len(convs) > 0, path
        for c in convs:
            assert c.messages[0].role in ("system", "user")
            assert all(m.content.strip() for m in c.messages)
            assert all(a.role != b.role for a, b in zip(c.messages, c.messages[1:]) if "user" != a.role or
                       any(m.role == "assistant" for m in c.messages))


def test_leading_assistant_turn_dropped_and_counted(shared, tmp_path):
    src = shared / "data" / "train" / "sharegpt_multiturn.jsonl"
    row = _first_row(src, lambda r: r["conversations"] and r["conversations"][0]["from"] == "gpt")
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps(row) + "\n")
    convs, skips, _ = _load(p)
    assert convs[0].messages[0].role == "user"
    assert skips.counts["leading assistant turn dropped"] >= 1


def test_consecutive_same_role_turns_merged(shared, tmp_path):
    src = shared / "data" / "train" / "sharegpt_multiturn.jsonl"

    def has_repeat(r):
        c = r["conversations"]
        first_user = next((i for i, t in enumerate(c) if t["from"] == "human"), len(c))
        c = [t for t in c[first_user:] if t["value"].strip()]
        return any(a["from"] == b["from"] for a, b in zip(c, c[1:]))

    row = _first_row(src, has_repeat)
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps(row) + "\n")
    convs, skips, _ = _load(p)
    assert any("merged" in r for r in skips.counts)
    msgs = convs[0].messages
    assert all(a.role != b.role for a, b in zip(msgs, msgs[1:]))


def test_system_prompt_kept(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "system", "content": "Be terse."},
                                          {"role": "user", "content": "Hi"},
                                          {"role": "assistant", "content": "Hello."}]}) + "\n")
    convs, _, _ = _load(p)
    assert [m.role for m in convs[0].messages] == ["system", "user", "assistant"]


def test_alpaca_gsm8k_and_prompts(shared):
    convs, _, _ = _load(shared / "data" / "train" / "alpaca_en_demo.json", max_rows=5)
    assert [m.role for m in convs[0].messages] == ["user", "assistant"]
    convs, _, _ = _load(shared / "data" / "train" / "gsm8k_train.jsonl", max_rows=5)
    assert "####" in convs[0].messages[1].content
    convs, _, _ = _load(shared / "data" / "eval" / "mt_bench.jsonl", max_rows=3)
    assert [m.role for m in convs[0].messages] == ["user", "user"]


def test_bad_rows_are_counted_with_file_line_and_field(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(
        b'{"messages": [{"role": "user", "content": "ok"}]}\n'
        b'{"messages": [{"role": "user", "content": 5}]}\n'
        b'{not json\n'
        b'{"messages": [{"role": "wizard", "content": "x"}]}\n'
        b'{"prompt": "caf\xff"}\n'
        b'{"foo": 1}\n'
    )
    convs, skips, stats = _load(p)
    assert len(convs) == 1 and stats["rows_skipped"] == 5
    ex = [e for v in skips.examples.values() for e in v]
    wheres = {e["where"] for e in ex}
    assert {f"{p}:{i}" for i in (2, 3, 4, 5, 6)} <= wheres
    assert any(e["field"] == "messages[0].content" for e in ex)
    assert any("unknown role" in e["reason"] for e in ex)
    assert any("UTF-8" in e["reason"] for e in ex)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="not found"):
        _load(tmp_path / "missing.jsonl")


def test_ids_are_stable_and_content_based(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps({"prompt": "Same"}) + "\n" + json.dumps({"text": "Same"}) + "\n")
    convs, _, _ = _load(p)
    assert convs[0].id == convs[1].id
    convs2, _, _ = _load(p)
    assert convs2[0].id == convs[0].id
