"""Prompts the target writes itself (the Magpie method, arXiv 2406.08464): the target is given its own chat
template's text up to where a user message begins (the default system prompt included) and samples what follows
until its end-of-turn token; what it writes is a user turn drawn from the target's own idea of its users.

Such prompts widen the training set towards what the served model is asked in practice, in the target's own
distribution, without a dataset. They become ordinary prepare conversations (one user turn each); the generate stage
then regenerates the reply as for any other prompt, and prepare's content hash removes repeats.

The prefix comes from rendering a one-message conversation whose content is a marker and cutting at the marker, so
every chat template works as the server renders it (``tokenize.chat_template_kwargs`` included).

Steering (the Magpie paper's system-prompt control, section 2): with ``system_prompts``, prompt i is sampled after
system message ``system_prompts[i % n]`` rendered by the template (``None``: the template's own default system
turn), so that a user can ask for more of the kinds of prompt a domain needs (writing, STEM, roleplay) while the
target still writes them in its own words. The system message is used only to sample the prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..data.chat import render_prompt
from .engine import GenRequest, GenResult

MARKER = "\u2063EYAS_USER_TURN\u2063"


def user_turn_prefix(tokenizer, chat_template_kwargs: dict | None = None, system: str | None = None) -> str:
    """The chat template's text before a user message's content (system turn and role header included); with
    ``system``, after that system message instead of the template's default.

    Raises ``ValueError`` when the template does not place a user message's content verbatim in its output, or does
    not render ``system`` verbatim (a template without a system role)."""
    msgs = ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": MARKER}]
    try:
        text = render_prompt(tokenizer, msgs, chat_template_kwargs=chat_template_kwargs)
    except Exception as e:  # jinja's raise_exception (e.g. "System role not supported") or a template error
        if system is None:
            raise
        raise ValueError(f"the chat template does not take a system message ({e}): leave "
                         f"prepare.self_prompts.system_prompts unset for this target") from e
    at = text.find(MARKER)
    if at < 0:
        raise ValueError("the chat template does not render a user message's content verbatim")
    if system is not None and system not in text[:at]:
        raise ValueError(f"the chat template does not render the system message {system[:60]!r} verbatim: leave "
                         f"prepare.self_prompts.system_prompts unset for this target")
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
    kept_by_system: list[int] | None = None   # with system_prompts: prompts kept after each system message


def sample_self_prompts(engine, tokenizer, count: int, *, max_tokens: int, chat_template_kwargs: dict | None = None,
                        min_chars: int = 8, on_prompt: Callable[[str], None] | None = None,
                        system_prompts: list[str | None] | None = None) -> tuple[list[str], SelfPromptStats]:
    """Sample ``count`` user turns with ``engine`` (a :class:`~eyas.generation.engine.SlotEngine` or
    :class:`~eyas.generation.inprocess.GenerateEngine` built with ``temperature > 0``); with ``system_prompts``,
    turn i after system message ``system_prompts[i % n]`` (``None``: the template's default system turn).

    Kept: texts ended by an end-of-turn token (a turn cut at ``max_tokens`` is incomplete), stripped of surrounding
    whitespace, at least ``min_chars`` long, not seen before. Returns the prompts in completion order and the counts
    (``kept_by_system``: how many were kept after each system message). Raises ``ValueError`` from
    :func:`user_turn_prefix`.
    """
    systems = list(system_prompts) if system_prompts else [None]
    prefixes = [tokenizer(user_turn_prefix(tokenizer, chat_template_kwargs, system=s),
                          add_special_tokens=False).input_ids for s in systems]
    queue = [GenRequest(i, prefixes[i % len(prefixes)], max_tokens) for i in range(count)]
    seen: set[str] = set()
    out: list[str] = []
    stats = SelfPromptStats(asked=count, kept_by_system=[0] * len(systems) if system_prompts else None)

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
            if stats.kept_by_system is not None:
                stats.kept_by_system[r.key % len(systems)] += 1
            if on_prompt:
                on_prompt(text)

    engine.run(feed, done)
    return out, stats
