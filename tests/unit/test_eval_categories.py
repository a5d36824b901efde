"""Evaluation per domain: a prompt set whose rows carry a category (MT-bench's eight) is also reported per category,
drafter beside n-gram lookup; the summary names the categories below ``evaluate.ngram_margin``; ``eyas report`` draws
both per set and per category; vLLM's per-request counts (histograms) give the same figures as its counters."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import yaml
from tiny import draft_for, sharp_target

import eyas.stages.evaluate as ev
from eyas.config import load_config
from eyas.errors import ConfigError
from eyas.evaluate.report import write_report
from eyas.evaluate.vllm_engine import add_request_counts
from eyas.stages import RunContext

MT_CATEGORIES = ["coding", "extraction", "humanities", "math", "reasoning", "roleplay", "stem", "writing"]


def _ctx(tmp_path, log=print, **evaluate) -> RunContext:
    raw = {"run_dir": str(tmp_path / "run"), "target": {"model": "x"},
           "prepare": {"sources": [{"path": "x"}]}, "evaluate": evaluate}
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(raw))
    return RunContext(cfg=load_config(p), log=log)


def test_categories_of_mt_bench_and_of_sets_without(tmp_path, shared):
    ev_dir = shared / "data" / "eval"
    ctx = _ctx(tmp_path, benchmarks=[{"name": "mt_bench", "path": str(ev_dir / "mt_bench.jsonl")},
                                     {"name": "gsm8k", "path": str(ev_dir / "gsm8k_test.jsonl"), "max_prompts": 3}])
    sets, cats = ev.load_sets(ctx), ev.load_categories(ctx)
    assert list(cats) == ["mt_bench"]                                   # GSM8K rows carry no category
    rows = [json.loads(x) for x in (ev_dir / "mt_bench.jsonl").read_text().splitlines() if x.strip()]
    assert [cats["mt_bench"][cid] for cid, _ in sets["mt_bench"]] == [r["category"] for r in rows]
    assert sorted(set(cats["mt_bench"].values())) == MT_CATEGORIES
    assert ev.load_categories(_ctx(tmp_path, category_field=None, benchmarks=[
        {"name": "mt_bench", "path": str(ev_dir / "mt_bench.jsonl")}])) == {}


def _row(cid, rounds, accepted, per_pos, ngram=None, **extra):
    r = {"id": cid, "rounds": rounds, "accepted": accepted, "accepted_per_pos": per_pos, **extra}
    if ngram:
        r["ngram"] = dict(zip(("rounds", "accepted", "accepted_per_pos"), ngram))
    return r


def test_category_counts_are_pooled_rows():
    rows = [_row("q1", 10, 8, [5, 2, 1], (12, 4, [3, 1, 0])),          # q1 and q2: two turns each
            _row("q1", 6, 0, [0, 0, 0], (6, 0, [0, 0, 0])),
            _row("q2", 4, 6, [3, 2, 1], (5, 5, [3, 1, 1])),
            _row("q3", 9, 9, [5, 3, 1], (10, 2, [2, 0, 0])),
            _row("q9", 1, 3, [1, 1, 1], (1, 3, [1, 1, 1]))]               # no category: left out
    got = ev.category_summaries(rows, {"q1": "math", "q2": "math", "q3": "writing"})
    assert list(got) == ["math", "writing"]
    m = got["math"]
    assert (m["prompts"], m["turns"], m["rounds"], m["accepted"], m["accepted_per_pos"]) == (2, 3, 20, 14, [8, 4, 2])
    assert m["acceptance_length"] == m["tokens_per_target_step"] == round(34 / 20, 4)
    assert m["acceptance_rate_per_position"] == [0.4, 0.2, 0.1]
    assert m["ngram"]["rounds"] == 23 and m["ngram"]["accepted_per_pos"] == [6, 2, 1]
    assert m["gain_over_ngram"] == round((34 / 20) / round(32 / 23, 4), 4)
    assert got["writing"]["gain_over_ngram"] == round(2.0 / 1.2, 4)
    # without n-gram counts on every row of a category, no n-gram figure is invented
    part = ev.category_summaries(rows[:1] + [_row("q2", 4, 6, [3, 2, 1])], {"q1": "math", "q2": "math"})
    assert "ngram" not in part["math"] and "gain_over_ngram" not in part["math"]


def test_vllm_request_histograms_give_counts_and_every_decode_step():
    # vLLM's RequestSpecDecodeMetrics: histogram[j] = verify steps with a draft that accepted j of k = 3 tokens
    c = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": [0, 0, 0], "generated": 0, "requests": 0}
    add_request_counts(c, SimpleNamespace(histogram=[22, 17, 0, 0], num_draft_tokens=74), 64, 3)   # seen on the CPU
    add_request_counts(c, SimpleNamespace(histogram=[11, 5, 2, 4], num_draft_tokens=35), 64, 3)
    add_request_counts(c, None, 5, 3)                                    # a request without metrics: tokens only
    assert (c["drafts"], c["draft_tokens"], c["accepted"]) == (61, 109, 38)
    assert c["accepted_per_pos"] == [28, 6, 4]       # vLLM's counters for these two requests: 61, 109, 38, [28, 6, 4]
    row = {"id": "q", **ev._conversation_counts(c)}
    s = ev.category_summaries([row], {"q": "coding"})["coding"]
    # tokens per target step as run_vllm's tokens_per_target_forward: (generated - requests) / (that - accepted)
    assert s["tokens_per_target_step"] == round((133 - 3) / (133 - 3 - 38), 4)
    assert s["acceptance_length"] == round(1 + 38 / 61, 4) and s["turns"] == 3 and s["prompts"] == 1


def test_suffix_baseline_needs_the_vllm_engine(tmp_path, shared):
    mt = str(shared / "data" / "eval" / "mt_bench.jsonl")
    with pytest.raises(ConfigError, match="evaluate.engine=vllm"):
        ev.check_config(_ctx(tmp_path, baseline=["ngram", "suffix"], benchmarks=[{"name": "mt", "path": mt}]))
    ev.check_config(_ctx(tmp_path, engine="vllm", baseline=["ngram", "suffix"], benchmarks=[{"name": "mt", "path": mt}]))


class _CharTokenizer:
    """Characters to ids modulo the tiny target's vocabulary (11); enough for the stage's loop."""

    eos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[ord(ch) % 11 for ch in text])

    def decode(self, ids, skip_special_tokens=True):
        return "".join("abcdefghijk"[i] for i in ids)


def _tiny_stage(monkeypatch):
    """The evaluate stage's reference loop on a tiny random target and draft (tests/tiny.py)."""
    target, layers = sharp_target(), [0, 2, 3]
    target.generation_config.eos_token_id = None
    draft = draft_for(target)
    tok = _CharTokenizer()
    monkeypatch.setattr(ev, "load_target", lambda cfg: SimpleNamespace(model=target, tokenizer=tok, num_layers=5,
                                                                       device=torch.device("cpu")))
    monkeypatch.setattr(ev, "load_target_head", lambda cfg: (target.model.embed_tokens.weight, None))
    monkeypatch.setattr(ev, "load_drafter", lambda folder, embed, num_target_layers: (
        draft, SimpleNamespace(layer_ids=lambda convention: layers)))
    monkeypatch.setattr(ev, "render_prompt", lambda tok, history, chat_template_kwargs=None: "".join(
        f"{m['role'][0]}:{m['content']}|" for m in history))


def test_stage_reports_categories_beside_ngram_and_names_those_below(tmp_path, monkeypatch):
    _tiny_stage(monkeypatch)
    rows = [{"question_id": i, "category": cat, "turns": [f"{cat} q{i} abcab", f"again {i} cabca"]}
            for i, cat in enumerate(["math", "math", "coding", "writing", "writing", "writing"])]
    rows.append({"question_id": 9, "turns": ["no category here"]})
    path = tmp_path / "mt.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = []
    ctx = _ctx(tmp_path, log=lines.append, max_new_tokens=12, ngram_margin=50.0,   # 50x: every category is below
               benchmarks=[{"name": "mt", "path": str(path), "format": "mt_bench"}])
    summary = ev.run(ctx)
    res = json.loads(ctx.run.evaluation.read_text())
    s = res["sets"]["mt"]
    assert list(s["categories"]) == ["coding", "math", "writing"]
    ids = {cid: cat for cid, cat in ev.load_categories(ctx)["mt"].items()}
    for cat, c in s["categories"].items():
        mine = [p for p in s["per_prompt"] if ids.get(p["id"]) == cat]
        assert c["turns"] == len(mine) == 2 * c["prompts"]
        assert c["rounds"] == sum(p["rounds"] for p in mine)
        assert c["accepted_per_pos"] == [sum(p["accepted_per_pos"][i] for p in mine) for i in range(3)]
        assert c["ngram"]["rounds"] == sum(p["ngram"]["rounds"] for p in mine)
        assert c["gain_over_ngram"] == round(c["tokens_per_target_step"] / c["ngram"]["tokens_per_target_step"], 4)
        assert c["lossless_mismatches"] is None
    assert sum(c["rounds"] for c in s["categories"].values()) + sum(
        p["rounds"] for p in s["per_prompt"] if p["id"] not in ids) == s["rounds"]
    assert s["lossless_mismatches"] == 0                                # the tiny loop stays lossless
    worst_first = sorted(s["categories"], key=lambda c: s["categories"][c]["gain_over_ngram"])
    assert res["categories_below_ngram_margin"] == [f"mt/{c}" for c in worst_first] == \
        summary.categories_below_ngram_margin
    assert res["ngram_margin"] == 50.0 and summary.sets["mt"].categories["math"].ngram.rounds > 0
    assert any(line.strip().endswith(")") and "mt/math: acceptance length" in line for line in lines)
    assert "below 50x n-gram" in lines[-1] and all(f"mt/{c} (" in lines[-1] for c in s["categories"])
    # a margin every category beats: none named
    assert ev.add_categories(res["sets"], {"mt": ids}, margin=0.01) == []


def test_report_draws_drafter_and_ngram_per_set_and_category(tmp_path):
    run = tmp_path / "run"
    (run / "evaluate").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"target": {"model": "/models/t"}}))

    def fig(tps, ng, **extra):
        return {"prompts": 2, "turns": 4, "rounds": 20, "acceptance_length": tps, "tokens_per_target_step": tps,
                "acceptance_rate_per_position": [0.5, 0.2, 0.1], "gain_over_ngram": round(tps / ng, 4),
                "ngram": {"prompts": 2, "rounds": 20, "acceptance_length": ng, "tokens_per_target_step": ng,
                          "acceptance_rate_per_position": [0.3, 0.1, 0.0]}, **extra}

    cats = {c: fig(1.3 + 0.1 * i, 1.2) for i, c in enumerate(MT_CATEGORIES)}
    (run / "evaluate" / "results.json").write_text(json.dumps({
        "engine": "vllm", "num_draft_tokens": 3, "acceptance_length": 1.6, "ngram_margin": 1.2,
        "categories_below_ngram_margin": ["mt_bench/coding", "mt_bench/extraction"],
        "sets": {"mt_bench": fig(1.65, 1.2, categories=cats), "gsm8k": fig(1.5, 1.4)}}))
    page = write_report(run)
    text = page.read_text()
    png = page.parent / "versus_ngram.png"
    assert png.stat().st_size > 5000 and 'src="versus_ngram.png"' in text
    from PIL import Image

    w, h = Image.open(png).size
    assert h > 1.5 * w * 3.8 / 11                                       # two panels: the sets, MT-bench's eight
    assert "mt_bench per category" in text and all(f"<td>{c}</td>" in text for c in MT_CATEGORIES)
    assert "<b>1.08x</b>" in text and "<td>1.25x</td>" in text          # coding below 1.2x (bold), humanities not
    assert "below 1.2x n-gram lookup" in text and "mt_bench/coding, mt_bench/extraction" in text
