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
    if path.suffix == ".json":
        return len(json.loads(path.read_text()))
    return sum(1 for line in path.open("rb") if line.strip())


def test_prepare_report_on_every_training_file_adds_up(shared, stories_dir, tmp_path):
    files = sorted((shared / "data" / "train").iterdir())
    cfg = tmp_path / "prep.yaml"
    cfg.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"), "target": {"model": str(stories_dir)},
        "prepare": {"sources": [{"path": str(f)} for f in files]},
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
