"""generate: the target regenerates every assistant turn, so the drafter learns the target's own replies.

In-process transformers backend: conversations are processed in batches (sorted by prompt length, left-padded),
turn by turn for multi-turn conversations (turn i is generated with the regenerated turns before it). Each
finished conversation is appended to ``generate/conversations.jsonl`` and fsynced as soon as its batch completes;
a re-run skips ids already there, so an interrupted run resumes where it stopped.

``generate.backend: openai`` sends the same turn-by-turn requests to an OpenAI-compatible server that serves the
target (vLLM, SGLang; :mod:`eyas.generation.openai_chat`): bounded concurrency, retries with back-off, time-outs,
reasoning text kept. Each conversation is appended and fsynced as soon as its last turn returns, in completion
order, so an interrupted run (kill, server gone) resumes from the ids already written, without duplicates.
Conversations the server refuses (too long for its context) are counted in ``generate/report.json``.

With ``generate.enabled: false`` the dataset's own assistant turns are kept (conversations without one are
skipped and counted).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from ..data.chat import render_prompt
from ..io import JsonlAppender, iter_jsonl, repair_jsonl_tail, write_json_atomic
from ..records import Conversation, Message, SkipCounter, SkipRecord, read_conversations
from ..targets.load import load_target, load_tokenizer, materialize_target
from . import RunContext

# tokenize.chat_template_kwargs: prompts are rendered with the template exactly as tokenize will render the replies
READS = ("generate", "target", "tokenize.chat_template_kwargs")
INPUTS = ("prepare",)


@torch.no_grad()
def generate_batch(model, tokenizer, prompts: list[str], cfg, generator_seed: int) -> list[tuple[str, str]]:
    """Generate one reply per prompt text (already rendered with the chat template).

    Returns ``(text, finish_reason)`` per prompt, ``finish_reason`` ``"stop"`` (end-of-turn token) or ``"length"``.
    """
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    kwargs = dict(max_new_tokens=cfg.max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    if cfg.temperature > 0:
        torch.manual_seed(generator_seed)
        kwargs.update(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    out = model.generate(**enc, **kwargs)
    new = out[:, enc.input_ids.shape[1]:]
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
    results = []
    for row in new.tolist():
        finish = "length"
        for j, t in enumerate(row):
            if t in eos_ids:
                row, finish = row[:j], "stop"
                break
        results.append((tokenizer.decode(row, skip_special_tokens=True).strip(), finish))
    return results


def run(ctx: RunContext) -> dict:
    cfg = ctx.cfg.generate
    out_path = ctx.run.generated
    convs = read_conversations(ctx.run.prepared)
    skips = SkipCounter()
    if not cfg.enabled:
        kept = 0
        with JsonlAppender(out_path, fsync_every=1 << 30) as w:
            out_path.write_text("")
            for c in convs:
                if not any(m.role == "assistant" for m in c.messages):
                    skips.add(SkipRecord(c.source or c.id, "no assistant turn and generate.enabled is false"))
                    continue
                w.append(c.to_json())
                kept += 1
        write_json_atomic(ctx.run.generate_report, {"samples": kept, "skips": skips.to_json()})
        return {"samples": kept, "regenerated": False, "skipped": skips.total}

    if out_path.exists():
        repair_jsonl_tail(out_path)  # a crash mid-write leaves at most one torn line: drop it, redo that sample
    done_ids = {d["id"] for _, d in iter_jsonl(out_path)} if out_path.exists() else set()
    todo = [c for c in convs if c.id not in done_ids]
    if done_ids:
        ctx.log(f"[eyas] generate: resuming, {len(done_ids)} of {len(convs)} conversations already generated")
    kwargs = ctx.cfg.tokenize.chat_template_kwargs
    if cfg.backend == "openai":
        return _run_openai(ctx, out_path, convs, todo, len(done_ids))
    target = load_target(ctx.cfg.target)
    tok = target.tokenizer
    # Longest prompts first: the largest batches run while memory is fresh, and padding stays small.
    todo.sort(key=lambda c: -sum(len(m.content) for m in c.messages))
    finish_counts = {"stop": 0, "length": 0}
    over_limit = 0  # turns not generated because their prompt reached generate.max_prompt_tokens
    bar = tqdm(total=len(convs), initial=len(done_ids), desc="generate", unit="conv", dynamic_ncols=True)
    with JsonlAppender(out_path) as w:
        for b in range(0, len(todo), cfg.batch_size):
            batch = todo[b: b + cfg.batch_size]
            # Per conversation: the user-only skeleton (system + user turns); assistant turns get regenerated.
            skel = [[m for m in c.messages if m.role != "assistant"] for c in batch]
            regenerated: list[list[Message]] = [[] for _ in batch]
            n_turns = [sum(m.role == "user" for m in s) for s in skel]
            for turn in range(max(n_turns)):
                idx, prompts = [], []
                for i, s in enumerate(skel):
                    if turn >= n_turns[i]:
                        continue
                    users_seen = 0
                    msgs: list[Message] = []
                    for m in s:
                        if m.role == "user":
                            if users_seen > turn:
                                break
                            users_seen += 1
                        msgs.append(m)
                    # interleave the replies generated so far after their user turns
                    history, r = [], 0
                    for m in msgs:
                        history.append(m)
                        if m.role == "user" and r < turn:
                            history.append(regenerated[i][r])
                            r += 1
                    text = render_prompt(tok, [m.to_dict() for m in history], chat_template_kwargs=kwargs)
                    if cfg.max_prompt_tokens and len(tok(text, add_special_tokens=False).input_ids) \
                            >= cfg.max_prompt_tokens:
                        n_turns[i] = turn  # this turn and later ones would start beyond the kept tokens
                        over_limit += 1
                        continue
                    idx.append(i)
                    prompts.append(text)
                if not prompts:
                    continue
                outs = generate_batch(target.model, tok, prompts, cfg, cfg.seed + b + turn)
                for i, (text, finish) in zip(idx, outs):
                    regenerated[i].append(Message("assistant", text))
                    finish_counts[finish] += 1
            for c, s, reps in zip(batch, skel, regenerated):
                msgs, r = [], 0
                for m in s:
                    if m.role == "user" and r == len(reps) and r > 0:
                        break  # turns past max_prompt_tokens are dropped (no reply was generated)
                    msgs.append(m)
                    if m.role == "user":
                        if r == len(reps):
                            break  # first turn already over max_prompt_tokens: kept as a prompt, tokenize skips it
                        msgs.append(reps[r])
                        r += 1
                w.append(Conversation(id=c.id, messages=msgs, source=c.source).to_json())
            w.flush()
            bar.update(len(batch))
    bar.close()
    total = len(done_ids) + len(todo)
    report = {"samples": total, "finish_reasons_this_run": finish_counts, "resumed_from": len(done_ids),
              "turns_over_max_prompt_tokens_this_run": over_limit}
    write_json_atomic(ctx.run.generate_report, report)
    return {"samples": total, "regenerated": True, "finish_length": finish_counts["length"]}


def _run_openai(ctx: RunContext, out_path, convs: list[Conversation], todo: list[Conversation], resumed: int) -> dict:
    """Backend 'openai': regenerate ``todo`` through the server, appending each conversation as it finishes."""
    import asyncio

    from ..generation.openai_chat import generate_conversations

    cfg = ctx.cfg.generate
    kwargs = ctx.cfg.tokenize.chat_template_kwargs
    prompt_tokens = None
    if cfg.max_prompt_tokens:
        tok = load_tokenizer(ctx.cfg.target)

        def prompt_tokens(messages: list[dict]) -> int:
            text = render_prompt(tok, messages, chat_template_kwargs=kwargs)
            return len(tok(text, add_special_tokens=False).input_ids)

    skips = SkipCounter()
    finish_counts = {"stop": 0, "length": 0}
    written = over_limit = 0
    bar = tqdm(total=len(convs), initial=resumed, desc="generate", unit="conv", dynamic_ncols=True)
    with JsonlAppender(out_path) as w:

        def on_result(res) -> None:
            nonlocal written, over_limit
            over_limit += res.over_max_prompt_tokens
            for s in res.skips:
                skips.add(s)
            for f in res.finish_reasons:
                finish_counts[f] += 1
            if res.conversation is not None:
                w.append(res.conversation.to_json())  # fsynced: finished work survives a kill
                written += 1
            bar.update(1)

        try:
            model = asyncio.run(generate_conversations(cfg, todo, on_result, kwargs, prompt_tokens))
        finally:
            bar.close()
    total = resumed + written
    report = {
        "samples": total, "backend": "openai", "server": cfg.openai.base_url, "served_model": model,
        "finish_reasons_this_run": finish_counts, "resumed_from": resumed,
        "turns_over_max_prompt_tokens_this_run": over_limit, "skips": skips.to_json(),
    }
    target_dir = materialize_target(ctx.cfg.target)
    if Path(model).expanduser().resolve() != target_dir.resolve():
        ctx.log(f"[eyas] generate: warning: the server serves '{model}', target.model is {target_dir}; the replies "
                f"are the target's only if that is the same model (serve the target folder to silence this)")
    write_json_atomic(ctx.run.generate_report, report)
    if skips.total:
        ctx.log(f"[eyas] generate: {skips.total} conversations refused or cut by the server; reasons in "
                f"{ctx.run.generate_report}")
    return {"samples": total, "regenerated": True, "finish_length": finish_counts["length"], "skipped": skips.total}
