"""Render conversations with the target's own chat template and compute the assistant loss mask.

This module is the one place Eyas turns ``messages`` into text, token ids and a loss mask. Everything downstream
(hidden-state capture, vocabulary counting, training) consumes :class:`RenderedConversation` and never re-renders.

Contract
--------
- ``text`` is exactly what ``tokenizer.apply_chat_template(messages, tokenize=False)`` produces with the
  tokenizer's own template (default system prompts, date lines, ``<think>`` handling, special tokens included):
  the features must be those the served model produces, so the conversation is never re-rendered some other way
  (FIELD_NOTES "Chat templates and loss masks"; SpecForge issues 296 and 885, speculators PR 814).
- ``input_ids`` is ``tokenizer(text, add_special_tokens=False)["input_ids"]``: what a server tokenizes; the
  template already writes BOS and friends.
- ``loss_mask[t]`` is 1 iff token t's character range overlaps an assistant span. A span is the text the model
  itself generates for an assistant turn: its content (and, where the template puts them there, the reasoning
  block or channel tokens the model emits after the generation prompt) up to and including the end-of-turn token
  (``<|im_end|>``, ``<|eot_id|>``, ``<｜end▁of▁sentence｜>``, ``<|end|>``/``<|return|>``, ...). Whitespace after the
  end-of-turn token is not trained (a server stops at the end-of-turn token). The assistant header (e.g.
  ``<|im_start|>assistant\\n``) and all system/user/tool text are never in a span; a token that merges header
  whitespace with the first content characters is trained (overlap rule), so the first assistant token always is.
- ``assistant_spans`` are character ``[start, end)`` ranges into ``text``, one per assistant turn, in order.

How spans are found (per assistant turn, first that works):
(a) the template has ``{% generation %}`` markers: transformers' assistant-mask machinery
    (``render_jinja_template(..., return_assistant_tokens_mask=True)``) gives character ranges directly;
(b) prefix differencing: ``P = render(messages[:i], add_generation_prompt=True)`` and
    ``F = render(messages[:i+1])``; when the full rendering starts with ``F`` and ``F`` starts with ``P``, the
    span is ``F[len(P):]`` up to the special (end-of-turn) token it ends with, trailing whitespace cut;
(c) content search, for templates that render earlier turns differently from how they were generated (Qwen3 drops
    earlier ``<think>`` blocks, gpt-oss ends earlier turns with ``<|end|>`` rather than ``<|return|>``): walk the
    messages in order, find each assistant content in the full rendering after the previous message, start the
    span right after the generation prompt when it sits just before the content (so gpt-oss's
    ``<|channel|>final<|message|>`` is trained as in (b)), and extend it to the end-of-turn token that follows.
If none works, :class:`ChatTemplateError` says which sample, which turn and why. Whatever the method, a span ends
with the turn's end-of-turn token: a ``{% generation %}`` block that closes before it (``{% endgeneration %}`` then
``<|im_end|>``) is extended over it, so the drafter learns to end a turn. Those end-of-turn tokens are given per
turn (:attr:`RenderedConversation.turn_ends`): a reply cut at the token limit never emitted them, and the tokenize
stage leaves them out of its mask (they stay in the input: the render is as served).

Inline reasoning: a reply that carries its reasoning inside its content (``<think>...</think>answer``, the form
Qwen3 and DeepSeek-R1 emit and servers without a reasoning parser return) is located as the template renders it.
Templates that parse the tags themselves (Qwen3: earlier turns' reasoning dropped, the last turn's kept) render the
message exactly as they render ``reasoning_content`` + answer; when that rendering is identical, the split form is
used to place the spans; otherwise the content is taken verbatim.

The reply check (:attr:`RenderedConversation.reply_issues`): the trained tokens must be the reply's own tokens. Each
reply's text (its answer and, where the template renders it in the turn, its reasoning) must appear verbatim in the
turn's span, and no token of the rendering may cross its start or end (a merge with the template's text around
it). Then the render's tokens over the reply are the tokenization of the reply's text on its own (BPE merges and
unigram segmentation never cross a boundary that no final token crosses), which is what "re-tokenizes to the same
tokens inside the render" means for text. A reply that holds an end-of-turn token's text (the target stops there, so
it cannot have emitted it mid-reply) or whose text the template rewrites is reported as ``changed``; a reply whose
only difference is whitespace at its ends (Llama 3 and Gemma trim contents; ChatML merges a leading newline into the
header's) is reported as ``whitespace``. Nothing is altered: the caller decides (tokenize skips ``changed`` samples
and counts both kinds).

Requires a fast (Rust) tokenizer: the mask uses its offset mapping.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import DataError

__all__ = [
    "ChatTemplateError",
    "RenderedConversation",
    "AssistantSpan",
    "ReplyIssue",
    "locate_assistant_spans",
    "render_conversation",
    "render_prompt",
    "split_harmony",
    "split_inline_reasoning",
]

_ROLES = ("system", "user", "assistant", "tool", "developer")
# Names of special tokens that end a turn (matched case-insensitively against the token text).
_EOT_NAME = re.compile(r"end|eot|eos|eom|return|stop|</s>", re.IGNORECASE)
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Reasoning written inline in a reply's content: (open, close) tags, as Qwen3 / DeepSeek-R1 / Kimi emit them.
_REASONING_TAGS = (("<think>", "</think>"),)


class ChatTemplateError(DataError, ValueError):
    """The conversation cannot be rendered, or its assistant spans cannot be located, with this template.

    The message names the sample (when given), the message index of the assistant turn and the reason.
    """


@dataclass(frozen=True)
class ReplyIssue:
    """A reply whose trained tokens are not its own text's tokens (see "The reply check" in the module doc).

    ``kind``: ``"changed"`` (rewritten, dropped or merged with template text, or holding end-of-turn token text)
    or ``"whitespace"`` (only whitespace at its ends differs); ``reason`` is stable across samples (for counting).
    """

    message_index: int
    kind: str
    reason: str


@dataclass(frozen=True)
class RenderedConversation:
    """One conversation rendered with the target's template, tokenized, with its assistant loss mask.

    Attributes:
        text: the full rendering, exactly as the template produces it (``add_generation_prompt=False``).
        input_ids: ``tokenizer(text, add_special_tokens=False)`` ids, length T.
        loss_mask: length T, 0/1; 1 on tokens overlapping an assistant span (content + end-of-turn token).
        assistant_spans: character ``[start, end)`` spans of trained text in ``text``, one per assistant turn.
        reply_issues: replies whose trained tokens are not their own text's tokens; empty when every reply
            survives the template.
        reply_tokens: ``(message index, t0, t1)`` per reply rendered verbatim: ``input_ids[t0:t1]`` are the tokens
            of its answer text inside the rendering, the tokens training sees for it (compared by ``tokenize``
            with the ids the target emitted).
        turn_ends: ``(message index, t0, t1)`` per located assistant turn: ``input_ids[t0:t1]`` are the trained
            tokens of its span after its answer text, the end-of-turn token(s) the template writes (SmolLM2's
            ``<|im_end|>``); ``tokenize`` takes them out of the mask for a reply cut at the token limit.
        reasoning_turns: ``(message index, rendered)`` per assistant turn that carries reasoning (its
            ``reasoning_content``, or a ``<think>`` block in its content): ``rendered`` when that reasoning lies in
            the turn's trained span, False where the template leaves it out (Qwen3's turns before the last user
            turn, templates that never render reasoning); ``tokenize`` counts both.
    """

    text: str
    input_ids: list[int]
    loss_mask: list[int]
    assistant_spans: list[tuple[int, int]]
    reply_issues: tuple[ReplyIssue, ...] = ()
    reply_tokens: tuple[tuple[int, int, int], ...] = ()
    turn_ends: tuple[tuple[int, int, int], ...] = ()
    reasoning_turns: tuple[tuple[int, bool], ...] = ()


@dataclass(frozen=True)
class AssistantSpan:
    """Where one assistant turn's trained text lies, and how it was found.

    ``message_index`` indexes ``messages``; ``method`` is ``"generation"`` (a), ``"prefix"`` (b) or
    ``"search"`` (c) as described in the module docstring.
    """

    message_index: int
    start: int
    end: int
    method: str


# --------------------------------------------------------------------------------------------------------------
# helpers


def _where(sample_id: Any, index: int | None = None) -> str:
    parts = []
    if sample_id is not None:
        parts.append(f"sample {sample_id!r}")
    if index is not None:
        parts.append(f"message {index}")
    return ", ".join(parts) if parts else "conversation"


def _check_messages(messages: Sequence[dict], sample_id: Any) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError(f"{_where(sample_id)}: messages must be a non-empty list of dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"{_where(sample_id, i)}: expected a dict with 'role' and 'content', got {m!r}")
        if m.get("role") not in _ROLES:
            raise ChatTemplateError(
                f"{_where(sample_id, i)}: role {m.get('role')!r} is not one of {', '.join(_ROLES)}"
            )
        if not isinstance(m.get("content"), str):
            raise ChatTemplateError(f"{_where(sample_id, i)}: 'content' must be a string, got {m.get('content')!r}")
        rc = m.get("reasoning_content")
        if rc is not None and not isinstance(rc, str):
            raise ChatTemplateError(f"{_where(sample_id, i)}: 'reasoning_content' must be a string or absent")


def _template_of(tokenizer, tools) -> str:
    try:
        return tokenizer.get_chat_template(None, tools)
    except Exception as exc:  # transformers raises ValueError when there is no template
        raise ChatTemplateError(f"tokenizer has no usable chat template: {exc}") from exc


def _normalise(messages: Sequence[dict], template: str) -> list[dict]:
    """Copy messages; map ``reasoning_content`` to ``thinking`` for templates that only read ``thinking``
    (gpt-oss / harmony), so reasoning is rendered the way that template expects."""
    uses_thinking = "thinking" in template and "reasoning_content" not in template
    out = []
    for m in messages:
        m = dict(m)
        if uses_thinking and m.get("reasoning_content") is not None and "thinking" not in m:
            m["thinking"] = m["reasoning_content"]
        out.append(m)
    return out


def split_inline_reasoning(content: str) -> tuple[str, str] | None:
    """``(reasoning, answer)`` of a reply that writes its reasoning inline in its content, or None when the content
    holds no closing tag.

    The reasoning is the text between the opening tag (or the start: the opening tag may sit in the generation
    prompt) and the first closing tag, ``"\\n"`` stripped at both ends; the answer is the text after the last closing
    tag with leading ``"\\n"`` stripped: how Qwen3's template splits a reply that has no ``reasoning_content``."""
    for open_tag, close_tag in _REASONING_TAGS:
        if close_tag in content:
            head = content.split(close_tag)[0]
            return head.split(open_tag)[-1].strip("\n"), content.split(close_tag)[-1].lstrip("\n")
    return None


def _split_inline_reasoning(messages: list[dict]) -> list[dict] | None:
    """Messages with inline reasoning moved to ``reasoning_content`` (:func:`split_inline_reasoning`), or None
    when no assistant message without ``reasoning_content`` has it."""
    out, changed = [], False
    for m in messages:
        if m["role"] == "assistant" and m.get("reasoning_content") is None:
            split = split_inline_reasoning(m.get("content") or "")
            if split is not None:
                m = {**m, "reasoning_content": split[0], "content": split[1]}
                changed = True
        out.append(m)
    return out if changed else None


def _render(tokenizer, messages, *, add_generation_prompt, kwargs, tools, sample_id, index=None) -> str:
    try:
        text = tokenizer.apply_chat_template(
            list(messages),
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    except Exception as exc:
        raise ChatTemplateError(
            f"{_where(sample_id, index)}: the chat template failed to render "
            f"({len(messages)} messages, add_generation_prompt={add_generation_prompt}): {exc}"
        ) from exc
    if not isinstance(text, str):
        raise ChatTemplateError(f"{_where(sample_id)}: apply_chat_template returned {type(text).__name__}, not str")
    return text


def _special_tokens(tokenizer) -> list[str]:
    """Texts of the tokenizer's special tokens, longest first."""
    toks: set[str] = set()
    try:
        for tok in tokenizer.added_tokens_decoder.values():
            if getattr(tok, "special", False) and tok.content:
                toks.add(tok.content)
    except Exception:
        pass
    for t in getattr(tokenizer, "all_special_tokens", []) or []:
        if t:
            toks.add(str(t))
    return sorted(toks, key=len, reverse=True)


def _eot_tokens(tokenizer) -> list[str]:
    """Special tokens that can end an assistant turn: the EOS token and special tokens named end/eot/eos/return."""
    eots = {t for t in _special_tokens(tokenizer) if _EOT_NAME.search(t)}
    eos = getattr(tokenizer, "eos_token", None)
    if eos:
        eots.add(str(eos))
    return sorted(eots, key=len, reverse=True)


def _cut_after_last_special(span_text: str, specials: Sequence[str]) -> int | None:
    """Length of ``span_text`` up to and including its last special token, when only whitespace follows it.

    Returns None when the span does not end (modulo trailing whitespace) with a special token.
    """
    stripped = span_text.rstrip()
    for tok in specials:
        if stripped.endswith(tok):
            return len(stripped)
    return None


def _generation_spans(tokenizer, messages, template, kwargs, tools, text, sample_id) -> list[tuple[int, int]] | None:
    """Method (a): character spans from ``{% generation %}`` markers, or None when unavailable."""
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except Exception:  # pragma: no cover - depends on the transformers version
        return None
    template_kwargs = {**getattr(tokenizer, "special_tokens_map", {}), **kwargs}
    try:
        rendered, indices = render_jinja_template(
            conversations=[list(messages)],
            tools=tools,
            chat_template=template,
            return_assistant_tokens_mask=True,
            add_generation_prompt=False,
            **template_kwargs,
        )
    except Exception as exc:
        raise ChatTemplateError(f"{_where(sample_id)}: the chat template failed to render: {exc}") from exc
    if rendered[0] != text:
        return None
    return [(int(s), int(e)) for s, e in indices[0] if e >= s]   # an empty reply's block is empty


# --------------------------------------------------------------------------------------------------------------
# span location


def locate_assistant_spans(
    tokenizer,
    messages: list[dict],
    *,
    chat_template_kwargs: dict | None = None,
    tools=None,
    sample_id: Any = None,
) -> tuple[str, list[AssistantSpan]]:
    """Render ``messages`` and find each assistant turn's trained character span (methods a/b/c, see module doc).

    Returns ``(text, spans)``: the full rendering and one :class:`AssistantSpan` per assistant message (per
    ``{% generation %}`` block for method (a)), in order, non-overlapping. Raises :class:`ChatTemplateError`
    when the template fails to render or a turn cannot be located.
    """
    text, spans, _ = _locate(tokenizer, messages, chat_template_kwargs, tools, sample_id)
    return text, spans


def _locate(tokenizer, messages, chat_template_kwargs, tools, sample_id) -> tuple[str, list[AssistantSpan], list]:
    """:func:`locate_assistant_spans`, plus the messages the spans were placed with (normalised: ``thinking`` for
    harmony, inline reasoning split where the template renders it the same way)."""
    _check_messages(messages, sample_id)
    kwargs = dict(chat_template_kwargs or {})
    template = _template_of(tokenizer, tools)
    msgs = _normalise(messages, template)
    text = _render(tokenizer, msgs, add_generation_prompt=False, kwargs=kwargs, tools=tools, sample_id=sample_id)
    split = _split_inline_reasoning(msgs)
    if split is not None:
        split = _normalise(split, template)
        try:
            same = _render(tokenizer, split, add_generation_prompt=False, kwargs=kwargs, tools=tools,
                           sample_id=sample_id) == text
        except ChatTemplateError:
            same = False
        if same:  # the template parses the tags itself: place spans with the parts it renders
            msgs = split
    specials = _special_tokens(tokenizer)
    eots = _eot_tokens(tokenizer)
    assistant_idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if not assistant_idx:
        return text, [], msgs

    # (a) {% generation %} markers
    if _GENERATION_TAG.search(template):
        gen = _generation_spans(tokenizer, msgs, template, kwargs, tools, text, sample_id)
        out = []
        for k, (s, e) in enumerate(gen or []):
            e2 = _through_end_of_turn(text, s, e, specials, eots)
            if e2 is None:  # no end-of-turn token after this block: use the other methods, which require one
                out = []
                break
            idx = assistant_idx[k] if len(gen) == len(assistant_idx) else -1
            out.append(AssistantSpan(idx, s, e2, "generation"))
        if out:
            return text, out, msgs

    spans: list[AssistantSpan] = []
    cursor = 0  # (c) searches after the previous message's located text
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            cursor = _advance_past(text, m["content"], cursor)
            continue
        span = _prefix_span(tokenizer, msgs, i, text, kwargs, tools, specials, sample_id)
        if span is not None and span[0] < cursor:
            span = None
        if span is None:
            span = _search_span(tokenizer, msgs, i, text, cursor, kwargs, tools, eots, sample_id)
            method = "search"
        else:
            method = "prefix"
        spans.append(AssistantSpan(i, span[0], span[1], method))
        cursor = span[1]
    return text, spans, msgs


def _through_end_of_turn(text: str, s: int, e: int, specials: Sequence[str], eots: Sequence[str]) -> int | None:
    """End of a ``{% generation %}`` span ``[s, e)`` so that it ends with the turn's end-of-turn token.

    Markers often enclose the newline after the end-of-turn token: cut after the block's last special token. A block
    that closes before the end-of-turn token (``{% endgeneration %}<|im_end|>``) is extended over the whitespace and
    the end-of-turn token that follow it: a server stops on that token, so the drafter must learn to emit it.
    Returns None when the block neither ends with an end-of-turn token nor is followed by one.
    """
    block = text[s:e]
    cut = _cut_after_last_special(block, specials)
    end = s + (cut if cut is not None else len(block.rstrip()))
    if any(text[s:end].endswith(t) for t in eots):
        return end
    rest = text[end:]
    gap = len(rest) - len(rest.lstrip())
    for tok in eots:
        if rest[gap:].startswith(tok):
            return end + gap + len(tok)
    return None


def _advance_past(text: str, content: str, cursor: int) -> int:
    """Move the cursor past a non-assistant message's content when it appears verbatim (or trimmed)."""
    for needle in (content, content.strip()):
        if needle:
            pos = text.find(needle, cursor)
            if pos >= 0:
                return pos + len(needle)
    return cursor


def _prefix_span(tokenizer, msgs, i, text, kwargs, tools, specials, sample_id) -> tuple[int, int] | None:
    """Method (b): prefix differencing for assistant message i; None when the renderings are not prefixes."""
    if i == 0:
        return None
    try:
        prompt = _render(tokenizer, msgs[:i], add_generation_prompt=True, kwargs=kwargs, tools=tools,
                         sample_id=sample_id, index=i)
        upto = _render(tokenizer, msgs[: i + 1], add_generation_prompt=False, kwargs=kwargs, tools=tools,
                       sample_id=sample_id, index=i)
    except ChatTemplateError:
        return None
    if not (text.startswith(upto) and upto.startswith(prompt)):
        return None
    block = upto[len(prompt):]
    content = msgs[i]["content"]
    if content.strip() and content.strip() not in block:
        return None
    cut = _cut_after_last_special(block, specials)
    if cut is None or cut == 0:
        return None
    return len(prompt), len(prompt) + cut


def _generation_prompt(tokenizer, msgs, i, kwargs, tools, sample_id) -> str:
    """The text add_generation_prompt=True appends after messages[:i] (e.g. ``<|im_start|>assistant\\n``)."""
    if i == 0:
        return ""
    try:
        with_gp = _render(tokenizer, msgs[:i], add_generation_prompt=True, kwargs=kwargs, tools=tools,
                          sample_id=sample_id, index=i)
        without = _render(tokenizer, msgs[:i], add_generation_prompt=False, kwargs=kwargs, tools=tools,
                          sample_id=sample_id, index=i)
    except ChatTemplateError:
        return ""
    return with_gp[len(without):] if with_gp.startswith(without) else ""


def _search_span(tokenizer, msgs, i, text, cursor, kwargs, tools, eots, sample_id) -> tuple[int, int]:
    """Method (c): find assistant message i after ``cursor`` and extend it to its end-of-turn token.

    The turn's header is located first (the generation prompt, or its first line: Qwen3's non-thinking prompt adds
    an empty ``<think></think>`` that earlier turns do not carry), then the content after it. The span starts
    right after the header when only model-generated text lies between (gpt-oss's ``<|channel|>final<|message|>``,
    trained as in (b)), else at the content.
    """
    content = msgs[i]["content"]
    gp = _generation_prompt(tokenizer, msgs, i, kwargs, tools, sample_id)
    headers = [h for h in dict.fromkeys([gp, gp.split("\n", 1)[0] + "\n" if "\n" in gp else "", gp.strip()]) if h]

    # The header must lie after the cursor and before the next message's content; earliest wins, longest on ties.
    limit = len(text)
    for later in msgs[i + 1:]:
        nxt = later["content"].strip()
        if nxt and text.find(nxt, cursor) >= 0:
            limit = text.find(nxt, cursor)
            break
    found = [(text.find(h, cursor, limit), h) for h in headers]
    found = [(p, h) for p, h in found if p >= 0]
    header_end = None
    if found:
        p, h = min(found, key=lambda f: (f[0], -len(f[1])))
        header_end = p + len(h)

    needles = [n for n in dict.fromkeys([content, content.strip()]) if n]
    if not needles:
        # Empty content: the turn runs from its header to the first end-of-turn token after it.
        if header_end is None:
            raise ChatTemplateError(
                f"{_where(sample_id, i)}: the assistant turn is empty and its header {gp!r} was not found in the "
                f"rendered text after character {cursor}"
            )
        hits = [(text.find(tok, header_end), tok) for tok in eots]
        hits = [(p, tok) for p, tok in hits if p >= 0]
        if not hits:
            raise ChatTemplateError(
                f"{_where(sample_id, i)}: the assistant turn is empty and no end-of-turn token "
                f"({', '.join(eots) or 'none known'}) follows its header"
            )
        p, tok = min(hits, key=lambda h: (h[0], -len(h[1])))
        return header_end, p + len(tok)

    # Reasoning rendered in this turn comes before the answer, and may contain the answer's words: search after it.
    reasoning = (msgs[i].get("reasoning_content") or msgs[i].get("thinking") or "").strip()
    after = None
    if reasoning:
        rp = text.find(reasoning, header_end if header_end is not None else cursor, limit)
        after = rp + len(reasoning) if rp >= 0 else None
    start = end = None
    for origin in dict.fromkeys([after, header_end, cursor]):
        if origin is None:
            continue
        for needle in needles:
            pos = text.find(needle, origin)
            if pos >= 0:
                start, end = pos, pos + len(needle)
                break
        if start is not None:
            break
    if start is None:
        raise ChatTemplateError(
            f"{_where(sample_id, i)}: cannot locate the assistant content in the rendered text after character "
            f"{cursor} (prefix differencing also failed); the template changes this turn's content. "
            f"Content starts {content[:60]!r}"
        )
    if header_end is not None and header_end <= start:
        between = text[header_end:start]
        if not any(m["content"].strip() and m["content"].strip() in between for j, m in enumerate(msgs) if j != i):
            start = header_end

    # Extend to the end-of-turn token: optional whitespace, then an end-of-turn special token.
    rest = text[end:]
    gap = len(rest) - len(rest.lstrip())
    for tok in eots:
        if rest[gap:].startswith(tok):
            return start, end + gap + len(tok)
    raise ChatTemplateError(
        f"{_where(sample_id, i)}: no end-of-turn token follows the assistant content (text after it: "
        f"{rest[:40]!r}; known end-of-turn tokens: {', '.join(eots) or 'none'})"
    )


# --------------------------------------------------------------------------------------------------------------
# public API


def render_conversation(
    tokenizer,
    messages: list[dict],
    *,
    chat_template_kwargs: dict | None = None,
    tools=None,
    sample_id: Any = None,
) -> RenderedConversation:
    """Render ``messages`` with ``tokenizer``'s own chat template, tokenize, and build the assistant loss mask.

    Args:
        tokenizer: a Hugging Face *fast* tokenizer with a chat template.
        messages: ``[{"role": "system"|"user"|"assistant", "content": str, "reasoning_content": str?}, ...]``.
            ``reasoning_content`` is rendered only where the template renders it (Qwen3 reads it directly; for
            templates that read ``thinking`` instead, gpt-oss, it is copied there); others drop it.
        chat_template_kwargs: extra template variables (e.g. ``{"enable_thinking": False}`` for Qwen3), exactly
            as the server is started with.
        tools: tool schemas passed to the template, as served.
        sample_id: only used in error messages.

    Returns:
        :class:`RenderedConversation`; ``len(input_ids) == len(loss_mask)``. A conversation without assistant
        turns gets an all-zero mask.

    Raises:
        ChatTemplateError: invalid messages, a template that fails to render, a slow tokenizer, or an assistant
            turn whose span cannot be located (see the module docstring for the methods tried).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ChatTemplateError(
            f"{_where(sample_id)}: loss masks need a fast tokenizer (offset mapping); "
            f"{type(tokenizer).__name__} is not one"
        )
    text, spans, msgs = _locate(tokenizer, messages, chat_template_kwargs, tools, sample_id)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    offsets = enc["offset_mapping"]
    char_spans = [(s.start, s.end) for s in spans]
    mask = [0] * len(ids)
    for t, (a, b) in enumerate(offsets):
        for s, e in char_spans:
            if (a < e and b > s) or (a == b and s <= a < e):
                mask[t] = 1
                break
    for sp in spans:
        if not any(mask[t] for t, (a, b) in enumerate(offsets) if a < sp.end and b > sp.start):
            raise ChatTemplateError(f"{_where(sample_id, sp.message_index)}: assistant span has no tokens")
    eots = _eot_tokens(tokenizer)
    issues = tuple(_reply_issues(text, offsets, spans, msgs, eots))
    return RenderedConversation(text=text, input_ids=ids, loss_mask=mask, assistant_spans=char_spans,
                                reply_issues=issues, reply_tokens=tuple(_reply_tokens(text, offsets, spans, msgs)),
                                turn_ends=tuple(_turn_ends(text, offsets, mask, spans, msgs, eots)),
                                reasoning_turns=tuple(_reasoning_turns(text, spans, msgs)))


def _reasoning_turns(text: str, spans: list[AssistantSpan], msgs: list[dict]):
    """``(message index, rendered)`` per assistant message that carries reasoning (``reasoning_content``,
    ``thinking`` or an inline ``<think>`` block): whether that reasoning lies verbatim (trimmed) in its
    turn's trained span (in any span when the spans cannot be matched to messages: ``{% generation %}`` blocks
    that do not pair with the assistant messages)."""
    by_index = {sp.message_index: text[sp.start:sp.end] for sp in spans if sp.message_index >= 0}
    trained = [text[sp.start:sp.end] for sp in spans]
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        inline = split_inline_reasoning(m.get("content") or "")
        reasoning = (m.get("reasoning_content") or m.get("thinking") or (inline[0] if inline else "")).strip()
        if reasoning:
            yield i, any(reasoning in s for s in ([by_index[i]] if i in by_index else trained))


def _reply_tokens(text: str, offsets, spans: list[AssistantSpan], msgs: list[dict]):
    """``(message index, t0, t1)``: the tokens lying inside each reply's answer text where the template renders
    it verbatim (the reply check makes sure no token crosses its ends)."""
    for sp in spans:
        content = (msgs[sp.message_index].get("content") or "") if sp.message_index >= 0 else ""
        at = text[sp.start:sp.end].rfind(content) if content else -1
        if at < 0:
            continue
        s, e = sp.start + at, sp.start + at + len(content)
        inside = [t for t, (a, b) in enumerate(offsets) if b > a and a >= s and b <= e]
        if inside:
            yield sp.message_index, inside[0], inside[-1] + 1


def _turn_ends(text: str, offsets, mask: list[int], spans: list[AssistantSpan], msgs: list[dict],
               eots: Sequence[str]):
    """``(message index, t0, t1)``: the trained tokens of each located turn's span that start after its answer text
    (the answer found as rendered, or trimmed; a turn whose answer the template rewrote: from its span's last
    end-of-turn token). A token that crosses the answer's end holds reply text and is not among them."""
    for sp in spans:
        if sp.message_index < 0:
            continue
        span = text[sp.start:sp.end]
        content = msgs[sp.message_index].get("content") or ""
        ends = [span.rfind(c) + len(c) for c in dict.fromkeys([content, content.strip()]) if c and c in span]
        if ends:
            cut = sp.start + ends[0]
        else:
            starts = [span.rfind(e) for e in eots if e in span]
            if not starts:
                continue
            cut = sp.start + max(starts)
        tail = [t for t, (a, _) in enumerate(offsets) if mask[t] and cut <= a < sp.end]
        if tail:
            yield sp.message_index, tail[0], tail[-1] + 1


def _reply_issues(text: str, offsets, spans: list[AssistantSpan], msgs: list[dict], eots: Sequence[str]):
    """The reply check of the module docstring, per located assistant turn (turns of unknown index are skipped).

    A token that crosses a reply's start or end is a whitespace issue when the reply's part of it is whitespace
    (its leading newline merged with the header's), else the reply was changed (``ti`` + ``me`` read as ``time``).
    """
    toks = [(a, b) for a, b in offsets if b > a]

    def crossing(pos: int) -> tuple[int, int] | None:
        return next(((a, b) for a, b in toks if a < pos < b), None)

    def merge_kind(start: int, piece: str) -> str | None:
        """None when no token crosses ``piece`` at ``start`` (its position in ``text``), else the issue's kind."""
        kinds = []
        head, tail = crossing(start), crossing(start + len(piece))
        if head:
            kinds.append("whitespace" if not piece[: head[1] - start].strip() else "changed")
        if tail:
            kinds.append("whitespace" if not piece[tail[0] - start:].strip() else "changed")
        return None if not kinds else ("changed" if "changed" in kinds else "whitespace")

    for sp in spans:
        if sp.message_index < 0:
            continue
        m = msgs[sp.message_index]
        span = text[sp.start:sp.end]
        # The answer is the turn's last text (rfind); reasoning, where the template renders it, comes first.
        pieces = [("reply", m.get("content") or "", span.rfind)]
        reasoning = m.get("reasoning_content") or m.get("thinking")
        if reasoning and reasoning.strip() and reasoning.strip() in span:
            pieces.append(("reasoning", reasoning, span.find))
        for what, piece, find in pieces:
            core = piece.strip()
            if not core:
                continue
            held = next((t for t in eots if t in core), None)
            if held is not None:
                yield ReplyIssue(sp.message_index, "changed", f"{what} holds end-of-turn token text {held!r}")
                continue
            exact, inner = find(piece), find(core)
            if inner < 0:
                yield ReplyIssue(sp.message_index, "changed", f"{what} not rendered verbatim by the template")
                continue
            kind = merge_kind(sp.start + exact, piece) if exact >= 0 else merge_kind(sp.start + inner, core)
            if kind == "changed":
                yield ReplyIssue(sp.message_index, "changed", f"a token crosses the {what}'s text and the "
                                                              f"template's around it")
            elif exact < 0:
                yield ReplyIssue(sp.message_index, "whitespace", f"{what}'s leading/trailing whitespace changed by "
                                                                 f"the template")
            elif kind == "whitespace":
                yield ReplyIssue(sp.message_index, "whitespace", f"{what}'s leading/trailing whitespace merged into "
                                                                 f"the template's tokens")


def render_prompt(
    tokenizer,
    messages: list[dict],
    *,
    chat_template_kwargs: dict | None = None,
    tools=None,
    sample_id: Any = None,
) -> str:
    """The text a server prefills before generating the next assistant reply.

    ``messages`` must end with a user (or tool) turn; it is rendered with ``add_generation_prompt=True`` and the
    same template variables as :func:`render_conversation`. Raises :class:`ChatTemplateError` when the last message
    is an assistant turn or the template fails.
    """
    _check_messages(messages, sample_id)
    if messages[-1]["role"] not in ("user", "tool"):
        raise ChatTemplateError(
            f"{_where(sample_id, len(messages) - 1)}: a prompt must end with a user turn, not "
            f"{messages[-1]['role']!r}; drop the reply first"
        )
    template = _template_of(tokenizer, tools)
    msgs = _normalise(messages, template)
    return _render(tokenizer, msgs, add_generation_prompt=True, kwargs=dict(chat_template_kwargs or {}),
                   tools=tools, sample_id=sample_id)


_HARMONY = re.compile(r"<\|channel\|>(\w+)<\|message\|>(.*?)(?:<\|end\|>(?:<\|start\|>assistant)?|$)", re.S)


def split_harmony(text: str) -> tuple[str, str | None] | None:
    """A gpt-oss (harmony) reply as the target emitted it, special tokens kept
    (``<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...``), as
    ``(final content, analysis reasoning or None)``: the form its chat template renders a reply from (the reasoning
    goes to ``thinking``/``reasoning_content``, kept for the last turn). ``None`` for text that is not one, or that
    holds other channels (tool calls): those are kept verbatim, and the template check decides."""
    if not text.startswith("<|channel|>"):
        return None
    parts = _HARMONY.findall(text)
    if not parts or "".join(f"{c}{m}" for c, m in parts) == "" or any(c not in ("analysis", "final")
                                                                       for c, _ in parts):
        return None
    final = [m for c, m in parts if c == "final"]
    if len(final) != 1:
        return None
    analysis = "".join(m for c, m in parts if c == "analysis")
    return final[0], (analysis or None)
