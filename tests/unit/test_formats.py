"""prepare: formats, normalisation rules and bad input, with rows taken from ../shared/data/train."""

import json

import pytest

from eyas.config import SourceConfig, SourceFields
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


# A layout Eyas cannot tell alone: LeetCodeDataset rows hold `prompt` (an import header) and `query` (the problem)
MAPPED = {"leetcode_train.jsonl.gz": SourceFields(prompt="query", response="response")}


def test_every_training_file_loads_and_counts_add_up(shared):
    for path in sorted((shared / "data" / "train").iterdir()):
        skips, stats = SkipCounter(), {}
        convs = list(load_source(SourceConfig(path=str(path), max_rows=300, fields=MAPPED.get(path.name)), skips,
                                 stats))
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


# ---- real-world quirks, each from a row of ../shared/data/train (docs/data.md explains each rule) ----

def _row_file(tmp_path, row, name="x.jsonl"):
    p = tmp_path / name
    p.write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8")
    return p


def _multiturn(shared):
    return [json.loads(x) for x in (shared / "data" / "train" / "sharegpt_multiturn.jsonl").open(encoding="utf-8")]


def test_real_system_prompt_is_kept_first(shared, tmp_path):
    row = next(r for r in _multiturn(shared) if r["conversations"] and r["conversations"][0]["from"] == "system")  # id ufsbA0x_0
    convs, skips, _ = _load(_row_file(tmp_path, row))
    m = convs[0].messages
    assert m[0].role == "system" and m[0].content == row["conversations"][0]["value"]
    assert [x.role for x in m[1:3]] == ["user", "assistant"]
    assert skips.total == 0


def test_real_empty_turn_dropped_then_neighbours_merged(shared, tmp_path):
    # line 137: gpt, human '', gpt, human, gpt -> the empty human turn goes, its two gpt neighbours meet
    row = next(r for r in _multiturn(shared) if any(t["from"] == "human" and not t["value"].strip()
                                                      for t in r["conversations"]))
    convs, skips, _ = _load(_row_file(tmp_path, row))
    assert skips.counts["empty turn dropped"] == 1
    ex = skips.examples["empty turn dropped"][0]
    blank = next(j for j, t in enumerate(row["conversations"]) if not t["value"].strip())
    assert ex["field"] == f"turn {blank}"
    msgs = convs[0].messages
    assert all(m.content.strip() for m in msgs)
    assert all(a.role != b.role for a, b in zip(msgs, msgs[1:]))


def test_real_zero_width_only_turn_counts_as_empty(shared, tmp_path):
    rows = json.loads((shared / "data" / "train" / "sharegpt_sg90k_sampled.json").read_text(encoding="utf-8"))
    row = next(r for r in rows if [t["value"] for t in r["conversations"]] == ["\u200b"])  # id 5lXOVeW
    convs, skips, stats = _load(_row_file(tmp_path, row))
    assert convs == [] and stats["rows_skipped"] == 1
    assert skips.counts == {"empty turn dropped": 1, "no user turn": 1}


def test_real_very_long_turn_is_kept_whole(shared, tmp_path):
    rows = _multiturn(shared)
    row = max(rows, key=lambda r: max((len(t["value"]) for t in r["conversations"]), default=0))  # a 15,543-character turn
    longest = max((t["value"] for t in row["conversations"]), key=len)
    assert len(longest) > 15_000
    convs, _, _ = _load(_row_file(tmp_path, row))
    assert any(m.content == longest for m in convs[0].messages)  # not cut: tokenize truncates, and counts it


def test_real_non_english_text_kept_byte_for_byte_with_a_stable_id(shared, tmp_path):
    import re

    row = next(r for r in _multiturn(shared)
               if any(re.search(r"[\u4e00-\u9fff]", t["value"]) for t in r["conversations"]))
    convs, _, _ = _load(_row_file(tmp_path, row))
    texts = {m.content for m in convs[0].messages}
    cjk = [t["value"] for t in row["conversations"] if re.search(r"[\u4e00-\u9fff]", t["value"])]
    assert all(t in texts for t in cjk)  # no normalisation, no escaping
    # the same row written as a JSON list (ASCII-escaped) gives the same sample id
    p2 = tmp_path / "x.json"
    p2.write_text(json.dumps([row], ensure_ascii=True))
    convs2, _, _ = _load(p2)
    assert convs2[0].id == convs[0].id


# ---- parquet and the `datasets` library, from real rows ----

def test_parquet_rows_load_like_their_jsonl(shared, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = _multiturn(shared)[:20]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "sg.parquet")
    jl = tmp_path / "sg.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from_pq, sk_pq, st_pq = _load(tmp_path / "sg.parquet")
    from_jl, sk_jl, st_jl = _load(jl)
    assert [c.id for c in from_pq] == [c.id for c in from_jl] and len(from_pq) > 10
    assert sk_pq.counts == sk_jl.counts
    assert from_pq[0].source == f"{tmp_path / 'sg.parquet'}:row 1"
    alpaca = json.loads((shared / "data" / "train" / "alpaca_en_demo.json").read_text())[:7]
    pq.write_table(pa.Table.from_pylist(alpaca), tmp_path / "al.parquet")
    convs, _, stats = _load(tmp_path / "al.parquet", max_rows=5)
    assert stats["rows_read"] == 5 and convs[0].messages[0].content.startswith(alpaca[0]["instruction"])


def test_wrong_typed_parquet_column_is_a_counted_skip_with_its_field(shared, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [json.loads(x) for x in (shared / "data" / "train" / "gsm8k_train.jsonl").open()][:3]
    table = pa.table({"question": [r["question"] for r in rows], "answer": [1, 2, 3]})  # answer: int64
    pq.write_table(table, tmp_path / "g.parquet")
    convs, skips, stats = _load(tmp_path / "g.parquet", fmt="gsm8k")
    assert convs == [] and stats["rows_skipped"] == 3
    assert skips.examples["field 'answer' is int, expected a string"][0] == {
        "where": f"{tmp_path / 'g.parquet'}:row 1", "reason": "field 'answer' is int, expected a string",
        "field": "answer"}


def test_not_a_parquet_file_is_a_clear_error(tmp_path):
    (tmp_path / "x.parquet").write_bytes(b"PAR1 but not really")
    with pytest.raises(DataError, match="cannot read it as parquet"):
        _load(tmp_path / "x.parquet")


def test_datasets_folder_and_csv_load_like_the_jsonl(shared, tmp_path):
    datasets = pytest.importorskip("datasets")
    src = shared / "data" / "train" / "gsm8k_train.jsonl"
    rows = [json.loads(x) for x in src.open()][:12]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:8]),
                               "test": datasets.Dataset.from_list(rows[8:])})
    dd.save_to_disk(str(tmp_path / "gsm8k_disk"))
    ref, _, _ = _load(src, max_rows=12)
    train, _, st = _load(tmp_path / "gsm8k_disk")
    assert [c.id for c in train] == [c.id for c in ref[:8]] and st["rows_read"] == 8
    assert train[0].source == f"{tmp_path / 'gsm8k_disk'}[train]:row 1"
    skips, stats = SkipCounter(), {}
    test = list(load_source(SourceConfig(path=str(tmp_path / "gsm8k_disk"), split="test"), skips, stats))
    assert [c.id for c in test] == [c.id for c in ref[8:]]
    with pytest.raises(DataError, match="no split 'validation'"):
        list(load_source(SourceConfig(path=str(tmp_path / "gsm8k_disk"), split="validation"), skips, {}))
    datasets.Dataset.from_list(rows).to_csv(str(tmp_path / "gsm8k.csv"))
    from_csv, _, _ = _load(tmp_path / "gsm8k.csv")
    assert [c.id for c in from_csv] == [c.id for c in ref]


def test_hub_source_without_network_is_a_clear_error(monkeypatch):
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    # offline: the library answers at once instead of waiting on a network this machine may not have
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="hub:openai/gsm8k: the `datasets` library cannot load it"):
        _load("hub:openai/gsm8k")


def test_more_bad_input(tmp_path):
    p = tmp_path / "types.jsonl"
    p.write_text('[1, 2]\n{"conversations": "hi"}\n{"conversations": [{"from": "human"}]}\n'
                 '{"conversations": [{"value": "x"}]}\n{"turns": ["a", 3]}\n')
    convs, skips, stats = _load(p)
    assert convs == [] and stats["rows_skipped"] == 5
    fields = {e["where"].rsplit(":", 1)[1]: e["field"] for v in skips.examples.values() for e in v}
    assert fields == {"1": "", "2": "conversations", "4": "conversations[0].from", "5": "turns",
                      "3": ""}  # a turn with no text is empty; the row then has no user turn
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'[{"prompt": "caf\xe9"}]')
    with pytest.raises(DataError, match=r"bad\.json: invalid UTF-8 at byte 16"):
        _load(bad)
    (tmp_path / "x.xml").write_text("<a/>")
    with pytest.raises(DataError, match="unknown file type '.xml'"):
        _load(tmp_path / "x.xml")


# ---------------------------------------------------------------------------- the layouts of the nine new files
def test_each_new_layout_reads_by_content_with_its_turns(shared):
    train = shared / "data" / "train"
    expect = {  # file -> (rows it holds, roles of the first conversation)
        "gpteacher_codegen.json": (4535, ["user", "assistant"]),     # alpaca with `response`
        "gpteacher_roleplay.json": (1923, ["user", "assistant"]),
        "evol_code_r1.json": (1966, ["user", "assistant"]),          # alpaca without `input`
        "mbpp_train.jsonl": (473, ["user"]),                         # `text` is the prompt
        "awesome_chatgpt_prompts.csv": (1524, ["user"]),             # CSV, `prompt` column, fields up to 170 KB
        "oasst_prompts_350.jsonl": (350, ["user"]),                  # a bare JSON string per line
        "mtbench101.jsonl": (1388, None),                            # `history` of {user, bot} pairs
    }
    for name, (rows, roles) in expect.items():
        convs, skips, stats = _load(train / name)
        assert stats["rows_read"] == rows == stats["rows_kept"] + stats["rows_skipped"], name
        assert stats["rows_kept"] >= rows - 5, (name, stats["skipped_by_reason"])
        if roles:
            assert [m.role for m in convs[0].messages] == roles, name
    gpteacher = json.loads((train / "gpteacher_codegen.json").read_text())[0]
    conv = _load(train / "gpteacher_codegen.json", max_rows=1)[0][0]
    assert conv.messages[1].content == gpteacher["response"]
    assert conv.messages[0].content == f"{gpteacher['instruction']}\n\n{gpteacher['input']}"


def test_history_pairs_become_alternating_turns(shared):
    src = shared / "data" / "train" / "mtbench101.jsonl"
    rows = [json.loads(x) for x in src.open()]
    convs, _, stats = _load(src)
    assert stats["rows_kept"] == len(convs) >= len(rows) - 2
    by_row = {c.source: c for c in convs}
    row = next(r for r in rows if len(r["history"]) >= 3)
    i = rows.index(row) + 1
    conv = by_row[f"{src}:{i}"]
    want = [x for pair in row["history"] for x in (("user", pair["user"]), ("assistant", pair["bot"]))]
    assert [(m.role, m.content) for m in conv.messages] == want
    assert sum(len(r["history"]) for r in rows) == 4208        # SOURCES.md: 4,208 user turns


def test_gzip_is_told_by_content_not_name(shared, tmp_path):
    import gzip

    src = shared / "data" / "train" / "gsm8k_train.jsonl"
    ref, _, _ = _load(src, max_rows=20)
    blob = gzip.compress(b"".join(src.open("rb").readlines()[:20]))
    for name in ("g.jsonl.gz", "g.jsonl", "g.gz", "g"):     # a gzipped file named as plain, and one with no suffix
        (tmp_path / name).write_bytes(blob)
        got, _, st = _load(tmp_path / name)
        assert [c.id for c in got] == [c.id for c in ref] and st["rows_read"] == 20, name
        assert got[3].source == f"{tmp_path / name}:4"      # lines still located
    import bz2
    import lzma
    for mod, name in ((bz2, "g.json.bz2"), (lzma, "g.json.xz")):   # a JSON list, compressed two more ways
        rows = [json.loads(x) for x in src.open().readlines()[:20]]
        (tmp_path / name).write_bytes(mod.compress(json.dumps(rows).encode()))
        got, _, _ = _load(tmp_path / name)
        assert [c.id for c in got] == [c.id for c in ref], name
    # the shared gzipped LeetCode file, read with its mapping
    convs, _, st = _load_mapped(shared / "data" / "train" / "leetcode_train.jsonl.gz", prompt="query")
    assert st["rows_read"] == 1890 and convs[0].messages[0].content.startswith("Given an array of integers")


def _load_mapped(path, **fields):
    skips, stats = SkipCounter(), {}
    convs = list(load_source(SourceConfig(path=str(path), fields=SourceFields(**fields)), skips, stats))
    return convs, skips, stats


def test_ambiguous_layout_is_an_error_naming_file_row_and_columns(shared):
    path = shared / "data" / "train" / "leetcode_train.jsonl.gz"
    with pytest.raises(DataError) as e:
        _load(path)
    msg = str(e.value)
    assert f"{path}:1:" in msg and "'prompt'" in msg and "'query'" in msg and "fields.prompt" in msg
    assert "columns found" in msg and "'completion'" in msg


def test_field_mapping_reads_named_columns_and_counts_missing(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps({"q": "What is 2+2?", "a": "4", "sys": "Be brief."}) + "\n"
                 + json.dumps({"a": "no prompt here"}) + "\n")
    convs, skips, stats = _load_mapped(p, prompt="q", response="a", system="sys")
    assert [(m.role, m.content) for m in convs[0].messages] == [("system", "Be brief."), ("user", "What is 2+2?"),
                                                                 ("assistant", "4")]
    assert stats["rows_skipped"] == 1 and skips.examples["missing field 'q'"][0]["where"] == f"{p}:2"


def test_csv_rows_keep_their_line_and_long_fields(tmp_path):
    p = tmp_path / "x.csv"
    long = "word " * 40000                                  # 200 KB: over the csv module's default field limit
    p.write_text('act,prompt\nA,"first\nspans two lines"\nB,' + long + "\nC\n", encoding="utf-8")
    convs, skips, stats = _load(p)
    assert [c.source for c in convs] == [f"{p}:2", f"{p}:4"]
    assert convs[0].messages[0].content == "first\nspans two lines" and len(convs[1].messages[0].content) == len(long)
    assert stats["rows_skipped"] == 1                     # row C: no prompt value
