"""Prompts the target writes itself (the Magpie method, arXiv 2406.08464): the target is given its own chat
template's text up to where a user message begins (the default system prompt included) and samples what follows
until its end-of-turn token; what it writes is a user turn drawn from the target's own idea of its users.

Such prompts widen the training set towards what the served model is asked in practice, in the target's own
distribution, without a dataset. They become ordinary prepare conversations (one user turn each); the generate stage
then regenerates the reply as for any other prompt, and prepare's content hash removes repeats.

The prefix comes from rendering a one-message conversation whose content is a marker and cutting at the marker, so
every chat template works as the server renders it (``tokenize.chat_template_kwargs`` included).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..data.chat import render_prompt
from .engine import GenRequest, GenResult

MARKER = "\u2063EYAS_USER_TURN\u2063"


def user_turn_prefix(tokenizer, chat_template_kwargs: dict | None = None) -> str:
    """The chat template's text before a user message's content (system turn and role header included).

    Raises ``ValueError`` when the template does not place a user message's content verbatim in its output."""
    text = render_prompt(tokenizer, [{"role": "user", "content": MARKER}],
                         chat_template_kwargs=chat_template_kwargs)
    at = text.find(MARKER)
    if at < 0:
        raise ValueError("the chat template does not render a user message's content verbatim")
    return text[:at]


@dataclass
class SelfPromptStats:
    """Counts of one sampling run: asked, returned (non-empty, ended by the end-of-turn token), cut at the token
    limit, empty, repeated (same text as an earlier one)."""

    asked: int = 0
    kept: int = 0
    cut: int = 0
    empty: int = 0
    repeated: int = 0


def sample_self_prompts(engine, tokenizer, count: int, *, max_tokens: int, chat_template_kwargs: dict | None = None,
                        min_chars: int = 8, on_prompt: Callable[[str], None] | None = None
                        ) -> tuple[list[str], SelfPromptStats]:
    """Sample ``count`` user turns with ``engine`` (a :class:`~eyas.generation.engine.SlotEngine` or
    :class:`~eyas.generation.inprocess.GenerateEngine` built with ``temperature > 0``).

    Kept: texts ended by an end-of-turn token (a turn cut at ``max_tokens`` is incomplete), stripped of surrounding
    whitespace, at least ``min_chars`` long, not seen before. Returns the prompts in completion order and the counts.
    """
    prefix = user_turn_prefix(tokenizer, chat_template_kwargs)
    ids = tokenizer(prefix, add_special_tokens=False).input_ids
    queue = [GenRequest(i, ids, max_tokens) for i in range(count)]
    seen: set[str] = set()
    out: list[str] = []
    stats = SelfPromptStats(asked=count)

    def feed(n: int) -> list[GenRequest]:
        take = queue[:n]
        del queue[:n]
        return take

    def done(r: GenResult) -> None:
        if r.finish != "stop":
            stats.cut += 1
            return
        text = tokenizer.decode(r.token_ids, skip_special_tokens=True).strip()
        if len(text) < min_chars:
            stats.empty += 1
        elif text in seen:
            stats.repeated += 1
        else:
            seen.add(text)
            out.append(text)
            stats.kept += 1
            if on_prompt:
                on_prompt(text)

    engine.run(feed, done)
    return out, stats
