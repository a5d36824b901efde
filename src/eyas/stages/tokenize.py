"""tokenize: render each conversation with the target's own chat template and mask the assistant tokens.

Writes ``tokenize/samples.jsonl`` (:class:`~eyas.records.TokenizedSample` per line) and ``tokenize/meta.json``
(tokenizer identity, chat-template hash, token counts, truncations and skips). The mask is computed by
:func:`eyas.data.chat.render_conversation` from the exact rendering a server would tokenize.
"""

from __future__ import annotations

from tqdm import tqdm

from ..data.chat import ChatTemplateError, render_conversation
from ..io import JsonlAppender, sha256_bytes, write_json_atomic
from ..records import SkipCounter, SkipRecord, TokenizedSample, read_conversations
from ..summaries import TokenizeSummary
from ..targets.load import load_tokenizer, materialize_target
from . import RunContext

READS = ("tokenize", "target")
INPUTS = ("generate",)


def tokenizer_identity(tok) -> dict:
    """Facts that pin the tokenizer and template a store or drafter was made with."""
    template = tok.chat_template if isinstance(tok.chat_template, str) else str(tok.chat_template)
    return {
        "name_or_path": str(tok.name_or_path),
        "vocab_size": len(tok),
        "chat_template_sha256": sha256_bytes((template or "").encode()),
    }


def run(ctx: RunContext) -> TokenizeSummary:
    cfg = ctx.cfg.tokenize
    out = ctx.run.tokenized
    out.unlink(missing_ok=True)
    tok = load_tokenizer(ctx.cfg.target)
    convs = read_conversations(ctx.run.generated)
    skips = SkipCounter()
    n = tokens = trained = truncated = 0
    with JsonlAppender(out, fsync_every=1 << 30) as w:
        for c in tqdm(convs, desc="tokenize", unit="conv", dynamic_ncols=True):
            if any(m.role == "assistant" and not m.content.strip() for m in c.messages):
                skips.add(SkipRecord(c.source or c.id, "empty assistant reply", "messages"))
                continue
            try:
                r = render_conversation(tok, c.chat_messages(), chat_template_kwargs=cfg.chat_template_kwargs,
                                        sample_id=c.id)
            except ChatTemplateError as e:
                skips.add(SkipRecord(c.source or c.id, f"chat template: {e}"))
                continue
            ids, mask = r.input_ids, r.loss_mask
            if len(ids) > cfg.max_length:
                ids, mask = ids[: cfg.max_length], mask[: cfg.max_length]
                truncated += 1
            if sum(mask) == 0:
                skips.add(SkipRecord(c.source or c.id, "no assistant token within max_length"))
                continue
            w.append(TokenizedSample(c.id, ids, mask).to_json())
            n += 1
            tokens += len(ids)
            trained += sum(mask)
    meta = {
        "samples": n, "tokens": tokens, "assistant_tokens": trained, "truncated": truncated,
        "max_length": cfg.max_length, "chat_template_kwargs": cfg.chat_template_kwargs,
        "tokenizer": tokenizer_identity(tok), "target_path": str(materialize_target(ctx.cfg.target)),
        "skips": skips.to_json(),
    }
    write_json_atomic(ctx.run.tokenize_meta, meta)
    if skips.total:
        ctx.log(f"[eyas] tokenize: {skips.total} conversations skipped; reasons in {ctx.run.tokenize_meta}")
    return TokenizeSummary(samples=n, tokens=tokens, assistant_tokens=trained, truncated=truncated,
                           skipped=skips.total)
