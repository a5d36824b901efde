"""tokenize: render each conversation with the target's own chat template and mask the assistant tokens.

Writes ``tokenize/samples.jsonl`` (:class:`~eyas.records.TokenizedSample` per line) and ``tokenize/meta.json``
(tokenizer identity, chat-template hash, token counts, truncations and skips). The mask is computed by
:func:`eyas.data.chat.render_conversation` from the exact rendering a server would tokenize.

Each reply must re-tokenize to its own tokens inside the rendering (the reply check of :mod:`eyas.data.chat`): a
conversation with a reply the template changes (rewritten, merged with the template's text, holding an end-of-turn
token's text) is skipped and counted with the reason; replies whose only change is leading/trailing whitespace are
kept and counted under ``reply_whitespace_changed``. Nothing is altered silently.

A reply cut at the token limit (``finish_reason: length``, kept by generate and read from sources that say) gets no
end-of-turn label: the template's end-of-turn token after it stays in ``input_ids`` with loss mask 0; such turns are
counted in ``meta.json`` (``turns_cut_at_limit``), and assistant turns whose finish reason is unknown (older run
folders, sources that do not say) under ``turns_finish_unknown``: those are trained as finished replies.

Reasoning a reply carries (``reasoning_content``, or a ``<think>`` block in its content) is rendered where the
template renders it and trained there (Qwen3: a ``<think>`` block in the turns after the last user turn, inside
the trained span, as the model emits it); ``reasoning_turns`` in ``meta.json`` counts the assistant turns whose
reasoning is rendered and those whose reasoning the template leaves out (a server renders them the same way), and
the log says how many are left out.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from multiprocessing import get_context

from tqdm import tqdm

from ..data.chat import ChatTemplateError, RenderedConversation, render_conversation
from ..errors import DataError
from ..io import JsonlAppender, sha256_bytes, write_json_atomic
from ..records import SkipCounter, SkipRecord, TokenizedSample, read_conversations
from ..summaries import TokenizeSummary
from ..targets.load import load_tokenizer, materialize_target
from . import RunContext

READS = ("tokenize", "target")
INPUTS = ("generate",)
PARALLEL_FROM = 2000   # tokenize.workers null: a pool only from this many conversations (spawning costs seconds)


def tokenizer_identity(tok) -> dict:
    """Facts that pin the tokenizer and template a store or drafter was made with."""
    template = tok.chat_template if isinstance(tok.chat_template, str) else str(tok.chat_template)
    return {
        "name_or_path": str(tok.name_or_path),
        "vocab_size": len(tok),
        "chat_template_sha256": sha256_bytes((template or "").encode()),
    }


def source_file(source: str | None) -> str:
    """The source a conversation came from, without its row: ``file:line``, ``file:row N``, ``name[split]:row N``
    and ``self-prompts:i`` lose their last ``:`` part."""
    return (source or "unknown").rsplit(":", 1)[0]


def without_cut_turn_ends(messages, rendered) -> tuple[RenderedConversation, list[int]]:
    """``(rendered, cut)``: ``rendered`` with the end-of-turn tokens after every reply cut at the token limit
    (``Message.finish_reason == "length"``) out of its loss mask, and the indices of those messages.

    Served, such a reply was cut where the target would have gone on: it never emitted the template's end-of-turn
    token there, so the drafter must not learn to propose one (issue 19). The tokens stay in the input (the render
    is as served: the next turn's prompt holds them). A reply of unknown finish reason is trained as finished."""
    cut = [i for i, _, _ in rendered.turn_ends
           if messages[i].role == "assistant" and messages[i].finish_reason == "length"]
    if not cut:
        return rendered, []
    mask = list(rendered.loss_mask)
    for i, t0, t1 in rendered.turn_ends:
        if i in cut:
            mask[t0:t1] = [0] * (t1 - t0)
    return replace(rendered, loss_mask=mask), cut


def with_emitted_tokens(messages, rendered) -> tuple[list[int], list[int], list[int]]:
    """``(input_ids, loss_mask, spliced)``: the rendered conversation with every in-process reply's tokens inside it
    (``rendered.reply_tokens``) replaced by the ids the target emitted (``Message.token_ids``) where they differ;
    ``spliced`` lists those message indices.

    The text of a reply does not always tokenize back to what the target emitted: SmolLM2 emits ``'\\n\\n'`` as
    one token before a digit where its tokenizer splits it in two, and a reply cut at ``max_new_tokens`` can end
    inside a character. Served, the target's KV cache and the drafter's context hold the emitted ids, so those are
    trained (their loss mask is 1, as the reply's was). The swap is exact at both ends: the reply check
    (:func:`eyas.data.chat.render_conversation`) leaves no token crossing a verbatim reply's start or end.
    Replies stored as parts (harmony's reasoning and answer) are kept as rendered."""
    ids, mask = list(rendered.input_ids), list(rendered.loss_mask)
    spliced = []
    for i, t0, t1 in sorted(rendered.reply_tokens, key=lambda x: -x[1]):   # last first: earlier indices hold
        m = messages[i]
        if m.role != "assistant" or m.token_ids is None or m.reasoning_content:
            continue
        emitted = list(m.token_ids)
        if ids[t0:t1] != emitted:
            ids[t0:t1] = emitted
            mask[t0:t1] = [1] * len(emitted)
            spliced.append(i)
    return ids, mask, sorted(spliced)


@dataclass
class Tokenized:
    """One conversation's outcome (:func:`tokenize_one`): the sample or the reason it was skipped, and the counts."""

    source: str | None = None
    sample: TokenizedSample | None = None
    skip: SkipRecord | None = None
    whitespace: list[SkipRecord] = field(default_factory=list)   # kept replies the template's whitespace changed
    emitted: list[SkipRecord] = field(default_factory=list)      # replies trained on their emitted ids
    truncated: bool = False
    cut_turns: int = 0
    reasoning: list[bool] = field(default_factory=list)          # per reasoning turn: rendered by the template
    finish_unknown: int = 0
    unknown_regenerated: int = 0


def tokenize_one(tok, c, chat_template_kwargs: dict, max_length: int) -> Tokenized:
    """Render conversation ``c`` (:class:`~eyas.records.Conversation`) with ``tok``'s chat template into a
    :class:`~eyas.records.TokenizedSample` (ids and loss mask, at most ``max_length`` tokens), or the reason it is
    skipped. Pure: the same input gives the same output in any process (``tokenize.workers``)."""
    if any(m.role == "assistant" and not m.content.strip() for m in c.messages):
        return Tokenized(skip=SkipRecord(c.source or c.id, "empty assistant reply", "messages"))
    try:
        r = render_conversation(tok, c.chat_messages(), chat_template_kwargs=chat_template_kwargs, sample_id=c.id)
    except ChatTemplateError as e:
        return Tokenized(skip=SkipRecord(c.source or c.id, f"chat template: {e}"))
    changed = [i for i in r.reply_issues if i.kind == "changed"]
    if changed:  # its trained tokens would not be the reply's: never trained, never silently altered
        return Tokenized(skip=SkipRecord(c.source or c.id, f"reply changed by the chat template: "
                                         f"{changed[0].reason}", f"messages[{changed[0].message_index}]"))
    out = Tokenized(source=c.source, whitespace=[SkipRecord(c.source or c.id, i.reason, f"messages[{i.message_index}]")
                                for i in r.reply_issues])
    r, cut = without_cut_turn_ends(c.messages, r)
    ids, mask, swapped = with_emitted_tokens(c.messages, r)
    out.emitted = [SkipRecord(c.source or c.id, "reply text tokenizes differently from the ids the target emitted: "
                                                "the emitted ids are trained", f"messages[{i}]") for i in swapped]
    if len(ids) > max_length:
        ids, mask = ids[:max_length], mask[:max_length]
        out.truncated = True
    if sum(mask) == 0:
        out.skip = SkipRecord(c.source or c.id, "no assistant token within max_length")
        return out
    out.sample = TokenizedSample(c.id, ids, mask)
    out.cut_turns = len(cut)
    out.reasoning = [bool(rendered) for _, rendered in r.reasoning_turns]
    unknown = [m for m in c.messages if m.role == "assistant" and m.finish_reason is None]
    out.finish_unknown = len(unknown)
    out.unknown_regenerated = sum(m.token_ids is not None for m in unknown)   # in-process, before Eyas kept it
    return out


_WORKER: dict = {}


def _worker_init(target_cfg, chat_template_kwargs: dict, max_length: int) -> None:
    _WORKER.update(tok=load_tokenizer(target_cfg), kwargs=chat_template_kwargs, max_length=max_length)


def _worker_tokenize(c) -> Tokenized:
    return tokenize_one(_WORKER["tok"], c, _WORKER["kwargs"], _WORKER["max_length"])


def workers_for(cfg_workers: int | None, n_conversations: int) -> int:
    """Processes to tokenize ``n_conversations`` with: ``tokenize.workers``, or (null) one for fewer than
    :data:`PARALLEL_FROM` conversations and else ``min(8, CPUs)``."""
    if cfg_workers is not None:
        return cfg_workers
    return 1 if n_conversations < PARALLEL_FROM else max(1, min(8, len(os.sched_getaffinity(0))
                                                                if hasattr(os, "sched_getaffinity")
                                                                else os.cpu_count() or 1))


def _tokenized(ctx: RunContext, tok, convs) -> Iterator[Tokenized]:
    """Every conversation's :class:`Tokenized`, in input order, from one process or a pool (``tokenize.workers``;
    each worker loads the same tokenizer, and the output is the same byte for byte)."""
    cfg = ctx.cfg.tokenize
    n = workers_for(cfg.workers, len(convs))
    bar = tqdm(total=len(convs), desc="tokenize", unit="conv", dynamic_ncols=True)
    if n <= 1:
        for c in convs:
            yield tokenize_one(tok, c, cfg.chat_template_kwargs, cfg.max_length)
            bar.update()
    else:
        ctx.log(f"[eyas] tokenize: {len(convs)} conversations in {n} processes (tokenize.workers)")
        with ProcessPoolExecutor(n, mp_context=get_context("spawn"), initializer=_worker_init,
                                 initargs=(ctx.cfg.target, cfg.chat_template_kwargs, cfg.max_length)) as ex:
            for t in ex.map(_worker_tokenize, convs, chunksize=256):
                yield t
                bar.update()
    bar.close()


def run(ctx: RunContext) -> TokenizeSummary:
    cfg = ctx.cfg.tokenize
    out = ctx.run.tokenized
    out.unlink(missing_ok=True)
    tok = load_tokenizer(ctx.cfg.target)
    src = ctx.run.generated
    convs = read_conversations(src)
    if not convs:
        raise DataError(f"tokenize: {src} holds no conversation; rerun generate (and prepare) with --force")
    skips = SkipCounter()
    whitespace = SkipCounter()  # replies kept whose leading/trailing whitespace the template changed
    emitted_kept = SkipCounter()  # replies whose emitted ids replaced their text's tokens
    n = tokens = trained = truncated = cut_turns = unknown_finish = unknown_regenerated = 0
    reasoning = {"rendered": 0, "not_rendered": 0}   # assistant turns carrying reasoning, by what the template did
    by_source: dict[str, dict[str, int]] = {}  # the mix as training sees it: samples and tokens per source file
    with JsonlAppender(out, fsync_every=1 << 30) as w:
        for t in _tokenized(ctx, tok, convs):
            for rec in t.whitespace:
                whitespace.add(rec)
            for rec in t.emitted:
                emitted_kept.add(rec)
            truncated += t.truncated
            if t.skip is not None:
                skips.add(t.skip)
                continue
            ids, mask = t.sample.input_ids, t.sample.loss_mask
            w.append(t.sample.to_json())
            n += 1
            cut_turns += t.cut_turns
            for rendered in t.reasoning:
                reasoning["rendered" if rendered else "not_rendered"] += 1
            unknown_finish += t.finish_unknown
            unknown_regenerated += t.unknown_regenerated
            tokens += len(ids)
            trained += sum(mask)
            mix = by_source.setdefault(source_file(t.source), {"samples": 0, "tokens": 0, "assistant_tokens": 0})
            mix["samples"] += 1
            mix["tokens"] += len(ids)
            mix["assistant_tokens"] += sum(mask)
    meta = {
        "samples": n, "tokens": tokens, "assistant_tokens": trained, "truncated": truncated,
        "max_length": cfg.max_length, "chat_template_kwargs": cfg.chat_template_kwargs,
        "tokenizer": tokenizer_identity(tok), "target_path": str(materialize_target(ctx.cfg.target)),
        "skips": skips.to_json(), "reply_whitespace_changed": whitespace.to_json(),
        "replies_trained_as_emitted": emitted_kept.to_json(),
        "turns_cut_at_limit": cut_turns, "turns_finish_unknown": unknown_finish, "reasoning_turns": reasoning,
        "mix": [{"source": k, **v, "assistant_tokens_share": round(v["assistant_tokens"] / max(trained, 1), 4)}
                for k, v in by_source.items()],
    }
    write_json_atomic(ctx.run.tokenize_meta, meta)
    if skips.total:
        ctx.log(f"[eyas] tokenize: {skips.total} conversations skipped; reasons in {ctx.run.tokenize_meta}")
    if whitespace.total:
        ctx.log(f"[eyas] tokenize: {whitespace.total} replies kept whose leading/trailing whitespace the chat "
                f"template changed; listed in {ctx.run.tokenize_meta} (reply_whitespace_changed)")
    if emitted_kept.total:
        ctx.log(f"[eyas] tokenize: {emitted_kept.total} replies whose text tokenizes differently from what the "
                f"target emitted are trained on the emitted ids; listed in {ctx.run.tokenize_meta}")
    if cut_turns:
        ctx.log(f"[eyas] tokenize: {cut_turns} replies were cut at the token limit (finish reason 'length'): "
                f"trained without an end-of-turn token, which the target never emitted there; counted in "
                f"{ctx.run.tokenize_meta} (turns_cut_at_limit)")
    if reasoning["not_rendered"]:
        ctx.log(f"[eyas] tokenize: {reasoning['not_rendered']} assistant turns carry reasoning the chat template "
                f"does not render (Qwen3 renders it only after the last user turn; some templates never do): not "
                f"trained, as a server would not show it; {reasoning['rendered']} rendered and trained; counted in "
                f"{ctx.run.tokenize_meta} (reasoning_turns)")
    if unknown_regenerated:
        ctx.log(f"[eyas] tokenize: regenerated replies without a finish reason (generated before Eyas kept it): "
                f"{unknown_regenerated}; their end-of-turn token is trained, also after a reply that was cut at "
                f"generate.max_new_tokens; `eyas generate CONFIG --force` regenerates them with it")
    if n == 0:
        reasons = "\n".join(f"  {k} x {r}" for r, k in sorted(skips.counts.items(), key=lambda x: -x[1]))
        raise DataError(f"tokenize: none of the {len(convs)} conversations of {src} gave a training sample:\n"
                        f"{reasons}\n(examples in {ctx.run.tokenize_meta})")
    return TokenizeSummary(samples=n, tokens=tokens, assistant_tokens=trained, truncated=truncated,
                           skipped=skips.total, replies_whitespace_changed=whitespace.total,
                           replies_trained_as_emitted=emitted_kept.total, turns_cut_at_limit=cut_turns)
