"""generate: the target regenerates every assistant turn, so the drafter learns the target's own replies.

In-process transformers backend: conversations are processed in batches (sorted by prompt length, left-padded),
turn by turn for multi-turn conversations (turn i is generated with the regenerated turns before it). Each
finished conversation is appended to ``generate/conversations.jsonl`` and fsynced as soon as its batch completes;
a re-run skips ids already there, so an interrupted run resumes where it stopped.

With ``generate.enabled: false`` the dataset's own assistant turns are kept (conversations without one are
skipped and counted).
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from ..data.chat import render_prompt
from ..io import JsonlAppender, iter_jsonl, write_json_atomic
from ..records import Conversation, Message, SkipCounter, SkipRecord
from ..targets.load import load_target
from . import RunContext


def _load(ctx: RunContext, stage: str) -> list[Conversation]:
    return [Conversation.from_json(d) for _, d in iter_jsonl(ctx.stage_dir(stage) / "conversations.jsonl")]


def _user_prefixes(conv: Conversation) -> list[list[Message]]:
    """For each user turn, the messages up to and including it (system + earlier turns)."""
    return [conv.messages[: i + 1] for i, m in enumerate(conv.messages) if m.role == "user"]


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
    out_dir = ctx.stage_dir("generate")
    out_path = out_dir / "conversations.jsonl"
    convs = _load(ctx, "prepare")
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
        write_json_atomic(out_dir / "report.json", {"samples": kept, "skips": skips.to_json()})
        return {"samples": kept, "regenerated": False, "skipped": skips.total}

    done_ids = {d["id"] for _, d in iter_jsonl(out_path)} if out_path.exists() else set()
    todo = [c for c in convs if c.id not in done_ids]
    if done_ids:
        ctx.log(f"[eyas] generate: resuming, {len(done_ids)} of {len(convs)} conversations already generated")
    target = load_target(ctx.cfg.target)
    tok = target.tokenizer
    kwargs = ctx.cfg.tokenize.chat_template_kwargs
    # Longest prompts first: the largest batches run while memory is fresh, and padding stays small.
    todo.sort(key=lambda c: -sum(len(m.content) for m in c.messages))
    finish_counts = {"stop": 0, "length": 0}
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
                    idx.append(i)
                    prompts.append(render_prompt(tok, [m.to_dict() for m in history], chat_template_kwargs=kwargs))
                outs = generate_batch(target.model, tok, prompts, cfg, cfg.seed + b + turn)
                for i, (text, finish) in zip(idx, outs):
                    regenerated[i].append(Message("assistant", text))
                    finish_counts[finish] += 1
            for c, s, reps in zip(batch, skel, regenerated):
                msgs, r = [], 0
                for m in s:
                    msgs.append(m)
                    if m.role == "user":
                        msgs.append(reps[r])
                        r += 1
                w.append(Conversation(id=c.id, messages=msgs, source=c.source).to_json())
            w.flush()
            bar.update(len(batch))
    bar.close()
    total = len(done_ids) + len(todo)
    report = {"samples": total, "finish_reasons_this_run": finish_counts, "resumed_from": len(done_ids)}
    write_json_atomic(out_dir / "report.json", report)
    return {"samples": total, "regenerated": True, "finish_length": finish_counts["length"]}
