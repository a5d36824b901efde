"""generate: the target regenerates every assistant turn, so the drafter learns the target's own replies.

In-process ``transformers`` backend (:mod:`eyas.generation.inprocess`): turn by turn (turn i is prompted with the
replies regenerated before it), through a continuous-batching engine (:mod:`eyas.generation.engine`: slots refilled
as replies finish, the decode step replayed as a CUDA graph) or, for targets it does not cover, transformers'
``generate``. Each conversation is appended to ``generate/conversations.jsonl`` and fsynced as soon as its last turn
returns; a re-run skips ids already there, so an interrupted run resumes where it stopped. Replies are stored as
the target emitted them (token ids and their text, special tokens kept).

``generate.backend: openai`` sends the same turn-by-turn requests to an OpenAI-compatible server that serves the
target (vLLM, SGLang; :mod:`eyas.generation.openai_chat`): bounded concurrency, retries with back-off, time-outs,
reasoning text kept. Each conversation is appended and fsynced as soon as its last turn returns, in completion
order, so an interrupted run (kill, server gone) resumes from the ids already written, without duplicates.
Conversations the server refuses (too long for its context) are counted in ``generate/report.json``.

With ``generate.enabled: false`` the dataset's own assistant turns are kept (conversations without one are
skipped and counted). An empty input, or an output with no conversation, stops the stage with a :class:`DataError`
that says why (nothing reaches tokenize, vocab and train to fail there).
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from ..data.chat import render_prompt
from ..errors import DataError
from ..io import JsonlAppender, iter_jsonl, read_json, repair_jsonl_tail, write_json_atomic
from ..generation.inprocess import TurnScheduler, make_engine
from ..records import Conversation, SkipCounter, SkipRecord, read_conversations
from ..targets.load import load_target, load_tokenizer, materialize_target
from . import RunContext

# tokenize.*: prompts are rendered with the template exactly as tokenize will render the replies, and a turn whose
# prompt reaches tokenize.max_length (the default generate.max_prompt_tokens) is not generated: it would be cut there
READS = ("generate", "target", "tokenize.chat_template_kwargs", "tokenize.max_length")
INPUTS = ("prepare",)


def reads_target_weights(cfg) -> bool:
    """The in-process backend loads the target; a server (backend openai) serves its own copy of the weights."""
    return cfg.generate.enabled and cfg.generate.backend == "transformers"


def run(ctx: RunContext) -> dict:
    cfg = ctx.cfg.generate
    out_path = ctx.run.generated
    convs = read_conversations(ctx.run.prepared)
    if not convs:
        raise DataError(f"generate: {ctx.run.prepared} holds no conversation; rerun `eyas prepare CONFIG --force` "
                        f"(it names each source and what it yielded)")
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
        if kept == 0:
            raise DataError(f"generate: none of the {len(convs)} prepared conversations has an assistant turn, and "
                            f"generate.enabled is false: nothing to train on (set generate.enabled: true to have the "
                            f"target write the replies)")
        return {"samples": kept, "regenerated": False, "skipped": skips.total}

    if out_path.exists():
        repair_jsonl_tail(out_path)  # a crash mid-write leaves at most one torn line: drop it, redo that sample
    done_ids = {d["id"] for _, d in iter_jsonl(out_path)} if out_path.exists() else set()
    reused = _reuse(ctx, convs, done_ids) if cfg.reuse_from else 0
    todo = [c for c in convs if c.id not in done_ids]
    if not todo:
        write_json_atomic(ctx.run.generate_report, {"samples": len(done_ids), "reused_this_run": reused,
                                                    "reused_from": cfg.reuse_from, "new_tokens_this_run": 0})
        return {"samples": len(done_ids), "regenerated": True, "finish_length": 0}
    if done_ids:
        ctx.log(f"[eyas] generate: resuming, {len(done_ids)} of {len(convs)} conversations already generated")
    kwargs = ctx.cfg.tokenize.chat_template_kwargs
    if cfg.backend == "openai":
        return _run_openai(ctx, out_path, convs, todo, len(done_ids))
    target = load_target(ctx.cfg.target)
    tok = target.tokenizer
    limit = cfg.max_prompt_tokens or ctx.cfg.tokenize.max_length
    engine = make_engine(target.model, tok, cfg, prompt_limit=limit, log=ctx.log)
    bar = tqdm(total=len(convs), initial=len(done_ids), desc="generate", unit="conv", dynamic_ncols=True)
    with JsonlAppender(out_path) as w:

        def on_conversation(c: Conversation) -> None:
            w.append(c.to_json())    # fsynced: finished work survives a kill
            bar.update(1)

        sched = TurnScheduler(tok, todo, max_new_tokens=cfg.max_new_tokens, max_prompt_tokens=limit,
                              chat_template_kwargs=kwargs, on_conversation=on_conversation)
        try:
            stats = engine.run(sched.feed, sched.on_result)
        finally:
            bar.close()
    total = len(done_ids) + sched.conversations
    report = {"samples": total, "finish_reasons_this_run": sched.finish, "resumed_from": len(done_ids) - reused,
              "reused_this_run": reused, "reused_from": cfg.reuse_from,
              "turns_over_max_prompt_tokens_this_run": sched.over_limit, "max_prompt_tokens": limit,
              "engine": {"kind": type(engine).__name__, "slots": stats.slots, "cache_len": stats.cache_len,
                         "attention": stats.attention, "cuda_graph": stats.cuda_graph, "notes": stats.notes},
              "new_tokens_this_run": stats.new_tokens, "prompt_tokens_this_run": stats.prefill_tokens,
              "seconds_this_run": round(stats.seconds, 2),
              "new_tokens_per_s": round(stats.new_tokens_per_s, 1)}
    write_json_atomic(ctx.run.generate_report, report)
    ctx.log(f"[eyas] generate: {stats.new_tokens} new tokens in {stats.seconds:.1f} s "
            f"({stats.new_tokens_per_s:,.0f} new tokens/s, {stats.requests} turns, {type(engine).__name__}, "
            f"{stats.slots} slots, attention {stats.attention}, CUDA graph {stats.cuda_graph})")
    return {"samples": total, "regenerated": True, "finish_length": sched.finish["length"],
            "new_tokens_per_s": round(stats.new_tokens_per_s, 1)}


# generate's own settings: a run whose values of these equal ours wrote the replies we would write
_REUSE_KEYS = ("generate", "target", "tokenize.chat_template_kwargs", "tokenize.max_length")


def _reuse(ctx: RunContext, convs: list[Conversation], done_ids: set[str]) -> int:
    """Copy into this run's output the conversations that a ``generate.reuse_from`` run generated already (same
    sample id, so the same prompts), adding their ids to ``done_ids``; returns how many were copied.

    Raises :class:`DataError` for a folder whose generate stage has not finished, or ran with other target or
    generate settings (the differing fields named): its replies are not what this run would generate."""
    from ..run_folder import RunFolder
    from . import diff_values, fingerprint_values

    ours = fingerprint_values(ctx.cfg, "generate")
    want = {c.id for c in convs} - done_ids
    copied = 0
    with JsonlAppender(ctx.run.generated) as w:
        for folder in ctx.cfg.generate.reuse_from:
            other = RunFolder(Path(folder))
            if not other.done("generate").exists() or not other.fingerprint_values("generate").exists():
                raise DataError(f"generate.reuse_from: {folder} has no finished generate stage "
                                f"({other.done('generate')} is missing); run `eyas generate` there first")
            theirs = read_json(other.fingerprint_values("generate"))
            diffs: list[str] = []
            for key in _REUSE_KEYS:  # the values exclude neutral fields (device, server address, reuse_from)
                diff_values(theirs.get(key), ours.get(key), key, diffs)
            if diffs:
                raise DataError(f"generate.reuse_from: {folder} generated with other settings, so its replies are "
                                f"not this run's (there -> here): {'; '.join(diffs)}")
            for _, d in iter_jsonl(other.generated):
                if d["id"] in want:
                    w.append(d)
                    want.discard(d["id"])
                    done_ids.add(d["id"])
                    copied += 1
    ctx.log(f"[eyas] generate: {copied} of {len(convs)} conversations reused from {', '.join(ctx.cfg.generate.reuse_from)}"
            f"; {len(want)} to generate")
    return copied


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
    if total == 0:
        reasons = ", ".join(f"{n} x {r}" for r, n in sorted(skips.counts.items(), key=lambda x: -x[1])[:5])
        raise DataError(f"generate: the server answered none of the {len(convs)} conversations "
                        f"({reasons or 'no reason given'}); details in {ctx.run.generate_report}")
    return {"samples": total, "regenerated": True, "finish_length": finish_counts["length"], "skipped": skips.total}
