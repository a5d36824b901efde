"""Benchmark sets for `eyas evaluate` (MT-bench both turns, HumanEval, GSM8K from ../shared/data/eval) and the
`eyas report` page with its figures and serve commands."""

import json

import yaml

from eyas.config import load_config
from eyas.evaluate.report import serve_commands, write_report
from eyas.stages import RunContext
from eyas.stages.evaluate import load_sets


def _cfg(tmp_path, shared, **evaluate):
    raw = {"run_dir": str(tmp_path / "run"), "target": {"model": "x"},
           "prepare": {"sources": [{"path": "x"}]}, "evaluate": evaluate}
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(raw))
    return RunContext(cfg=load_config(p))


def test_benchmark_sets_from_shared_eval(tmp_path, shared):
    ev = shared / "data" / "eval"
    ctx = _cfg(tmp_path, shared, benchmarks=[
        {"name": "mt_bench", "path": str(ev / "mt_bench.jsonl"), "max_prompts": 3},
        {"name": "humaneval", "path": str(ev / "humaneval.jsonl"), "max_prompts": 2},
        {"name": "gsm8k", "path": str(ev / "gsm8k_test.jsonl"), "max_prompts": 2},
        {"name": "mt_first", "path": str(ev / "mt_bench.jsonl"), "max_prompts": 1, "turns": "first"}])
    sets = load_sets(ctx)
    assert list(sets) == ["mt_bench", "humaneval", "gsm8k", "mt_first"]
    first = json.loads((ev / "mt_bench.jsonl").read_text().splitlines()[0])
    assert sets["mt_bench"][0][1] == first["turns"] and len(first["turns"]) == 2     # both turns, in order
    assert len(sets["mt_first"][0][1]) == 1
    he = json.loads((ev / "humaneval.jsonl").read_text().splitlines()[0])
    assert sets["humaneval"][0][1] == [he["prompt"]]
    q = json.loads((ev / "gsm8k_test.jsonl").read_text().splitlines()[0])
    assert sets["gsm8k"][0][1] == [q["question"]]                                   # the answer is not a prompt
    assert [len(v) for v in sets.values()] == [3, 2, 2, 1]


def test_report_page(tmp_path):
    run = tmp_path / "run"
    (run / "train").mkdir(parents=True)
    (run / "evaluate").mkdir()
    (run / "export" / "sglang").mkdir(parents=True)
    (run / "export" / "vllm").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"target": {"model": "/models/t"}, "export": {
        "num_speculative_tokens": 4}}))
    rows = [{"step": s, "loss": 9 - s, "loss_0": 3 - s / 3, "acc_0": s / 10, "loss_1": 3.2 - s / 3, "acc_1": s / 12}
            for s in range(1, 6)]
    (run / "train" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "evaluate" / "results.json").write_text(json.dumps({
        "engine": "reference", "num_draft_tokens": 3, "acceptance_length": 1.9, "sets": {
            "mt_bench": {"prompts": 2, "rounds": 10, "acceptance_length": 2.1,
                         "acceptance_rate_per_position": [0.6, 0.35, 0.15], "speedup_estimate": 1.4},
            "gsm8k": {"prompts": 2, "rounds": 12, "acceptance_length": 1.7,
                      "acceptance_rate_per_position": [0.45, 0.2, 0.05]}}}))
    page = write_report(run)
    text = page.read_text()
    assert (page.parent / "training.png").stat().st_size > 1000
    assert (page.parent / "acceptance.png").stat().st_size > 1000
    assert 'src="training.png"' in text and 'src="acceptance.png"' in text
    assert "--speculative-algorithm EAGLE3" in text and "--speculative-num-steps 4" in text
    assert "&quot;method&quot;: &quot;eagle3&quot;" in text and "mt_bench" in text and "2.100" in text
    cmds = serve_commands(run, "/models/t", 4)
    assert "127.0.0.1" in cmds["SGLang"] and set(cmds) == {"SGLang", "vLLM (vllm folder)", "vLLM (sglang folder)"}
