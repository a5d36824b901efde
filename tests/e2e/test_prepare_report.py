"""`eyas prepare` on every file of ../shared/data/train: the data report's counts add up, and its histogram is
written. Uses the CLI command itself (typer's runner, in-process) with stories260K's tokenizer as the target's."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from eyas.cli import app
from eyas.io import iter_jsonl

pytestmark = pytest.mark.e2e


def _rows_in(path) -> int:
    import csv
    import gzip

    if path.suffix == ".json":
        return len(json.loads(path.read_text()))
    if path.suffix == ".csv":
        csv.field_size_limit(1 << 30)
        return sum(1 for _ in csv.DictReader(path.open(newline="", encoding="utf-8")))
    opener = gzip.open if path.suffix == ".gz" else open
    return sum(1 for line in opener(path, "rb") if line.strip())


# the one shared file whose layout needs naming: LeetCodeDataset's `prompt` is an import header, `query` the prompt
FIELDS = {"leetcode_train.jsonl.gz": {"prompt": "query"}}


def _source(f) -> dict:
    return {"path": str(f), **({"fields": FIELDS[f.name]} if f.name in FIELDS else {})}


def test_prepare_report_on_every_training_file_adds_up(shared, stories_dir, tmp_path):
    files = sorted((shared / "data" / "train").iterdir())
    assert len(files) == 14
    cfg = tmp_path / "prep.yaml"
    cfg.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"), "target": {"model": str(stories_dir)},
        "prepare": {"sources": [_source(f) for f in files]},
    }))
    res = CliRunner().invoke(app, ["prepare", str(cfg)])
    assert res.exit_code == 0, res.output
    out = tmp_path / "run" / "prepare"
    report = json.loads((out / "report.json").read_text())
    written = [d for _, d in iter_jsonl(out / "conversations.jsonl")]

    assert [s["path"] for s in report["sources"]] == [str(f) for f in files]
    for f, s in zip(files, report["sources"]):
        assert s["rows_read"] == _rows_in(f), f  # every row of the file was looked at
        assert s["rows_read"] == s["rows_kept"] + s["rows_skipped"], f
        assert sum(s["skipped_by_reason"].values()) == s["rows_skipped"], f
        mine = [d for d in written if d["source"].startswith(f"{f}:")]
        assert len(mine) == s["rows_kept"] == s["token_lengths"]["count"], f
        assert s["turns"] == sum(s["turns_by_role"].values()) == sum(len(d["messages"]) for d in mine), f
    t = report["totals"]
    for k in ("rows_read", "rows_kept", "rows_skipped", "turns"):
        assert t[k] == sum(s[k] for s in report["sources"]), k
    assert t["rows_kept"] == report["samples"] == len(written) == len({d["id"] for d in written})
    assert t["token_lengths"]["total"] == sum(s["token_lengths"]["total"] for s in report["sources"])
    dup = "duplicate conversation (same sample id)"
    assert report["duplicates"] == sum(s["skipped_by_reason"].get(dup, 0) for s in report["sources"]) > 0
    # the global skip counter holds row skips and turn changes of every source, with file:line examples
    by_reason = report["skips"]["by_reason"]
    for s in report["sources"]:
        for r in list(s["skipped_by_reason"]) + list(s["turn_changes"]):
            assert r in by_reason
    assert report["skips"]["total"] == t["rows_skipped"] + sum(
        n for s in report["sources"] for n in s["turn_changes"].values())
    ex = report["skips"]["examples"]["leading assistant turn dropped"][0]
    assert ex["where"].startswith(str(shared / "data" / "train")) and ex["field"].startswith("turn ")
    png = out / report["token_length_histogram"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_the_mix_decontaminated_near_duplicates_and_capped(shared, stories_dir, tmp_path):
    """All fourteen files with the headline's settings: no row overlaps an evaluation prompt, GSM8K capped by a
    seeded choice, near-copies removed, every drop counted per source with its reason, and the mix table adds up."""
    files = sorted((shared / "data" / "train").iterdir())
    ev = shared / "data" / "eval"
    sources = [_source(f) for f in files]
    gsm = next(s for s in sources if s["path"].endswith("gsm8k_train.jsonl"))
    gsm["max_conversations"] = 1000
    code = next(s for s in sources if s["path"].endswith("gpteacher_codegen.json"))
    code["max_tokens"] = 50_000
    prep = {"sources": sources, "seed": 3, "near_duplicates": {"threshold": 0.8},
            "decontaminate": {"sets": [{"path": str(ev / "mt_bench.jsonl"), "format": "mt_bench"},
                                       {"path": str(ev / "humaneval.jsonl"), "format": "prompts"},
                                       {"path": str(ev / "gsm8k_test.jsonl"), "format": "gsm8k"}]}}
    cfg = tmp_path / "prep.yaml"
    cfg.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), "target": {"model": str(stories_dir)},
                                   "prepare": prep}))
    res = CliRunner().invoke(app, ["prepare", str(cfg)])
    assert res.exit_code == 0, res.output
    out = tmp_path / "run" / "prepare"
    report = json.loads((out / "report.json").read_text())
    written = [d for _, d in iter_jsonl(out / "conversations.jsonl")]
    by_path = {s["path"]: s for s in report["sources"]}
    g = by_path[gsm["path"]]
    assert g["rows_kept"] == 1000 and g["mix_dropped"] == {"max_conversations": g["rows_read"] - 1000 - sum(
        n for r, n in g["skipped_by_reason"].items() if "mix" not in r)}
    c = by_path[code["path"]]
    assert 0 < c["token_lengths"]["total"] <= 50_000 and "max_tokens" in c["mix_dropped"]
    contaminated = {p: n for p, s in by_path.items() for r, n in s["skipped_by_reason"].items() if "evaluation" in r}
    near = sum(s["skipped_by_reason"].get("near-duplicate of an earlier conversation (prepare.near_duplicates)", 0)
               for s in report["sources"])
    assert sum(contaminated.values()) > 0 and near > 100        # evol_code_r2 holds evolved copies of r1's rows
    assert report["decontaminated_against"] == {"mt_bench.jsonl": 80, "humaneval.jsonl": 164, "gsm8k_test.jsonl": 1319}
    ex = report["skips"]["examples"]
    assert any(e["field"].startswith("shares '") for r, v in ex.items() if "evaluation" in r for e in v)
    # no kept user turn shares a 13-word n-gram with an evaluation prompt (checked here independently)
    from eyas.data.mix import words

    def grams(t):
        w = words(t)
        return {tuple(w[i:i + 13]) for i in range(len(w) - 12)}

    evalg = set()
    for line in (ev / "mt_bench.jsonl").open():
        for t in json.loads(line)["turns"]:
            evalg |= grams(t)
    for line in (ev / "humaneval.jsonl").open():
        evalg |= grams(json.loads(line)["prompt"])
    for line in (ev / "gsm8k_test.jsonl").open():
        evalg |= grams(json.loads(line)["question"])
    assert not any(grams(m["content"]) & evalg for d in written for m in d["messages"] if m["role"] == "user")
    # the mix table: per source conversations, user turns and tokens, shares summing to 1
    mix = report["mix"]
    assert [r["source"] for r in mix] == [s["path"] for s in report["sources"]]
    assert sum(r["conversations"] for r in mix) == report["samples"] == len(written)
    assert abs(sum(r["conversations_share"] for r in mix) - 1) < 1e-3
    assert all(s["rows_read"] == s["rows_kept"] + s["rows_skipped"] for s in report["sources"])
    # the seeded choice is the same on a re-run and a smaller cap keeps a subset
    first = {d["id"] for d in written if d["source"].startswith(gsm["path"])}
    gsm["max_conversations"] = 400
    cfg.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run2"), "target": {"model": str(stories_dir)},
                                   "prepare": prep}))
    assert CliRunner().invoke(app, ["prepare", str(cfg)]).exit_code == 0
    second = {d["id"] for _, d in iter_jsonl(tmp_path / "run2" / "prepare" / "conversations.jsonl")
              if d["source"].startswith(gsm["path"])}
    assert len(second) == 400 and second < first
