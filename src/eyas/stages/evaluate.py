"""evaluate: acceptance length of the exported drafter per prompt set, by the reference decoder or by vLLM.

Sets: ``evaluate.prompts`` (one set, ``held_out``) and ``evaluate.benchmarks`` (named sets: MT-bench with both
turns, HumanEval, GSM8K, any JSONL of prompts). Every user turn of a conversation is decoded in order, the model's
own reply going into the next turn's prompt.

- ``engine: reference``: :mod:`eyas.evaluate.decoder` (chain or tree, greedy or sampling) on the exported folder
  (what an engine loads, so evaluation also proves the export). Greedy runs are checked token for token against the
  target's own decoding (``check_lossless``), which also times plain target steps for the speedup estimate.
- ``engine: vllm``: vLLM serves the target with the exported folder and reports acceptance from its own counters
  (:mod:`eyas.evaluate.vllm_engine`; chain drafting only).

Writes ``evaluate/results.json`` (per set and overall; per prompt for the reference decoder).
"""

from __future__ import annotations

from tqdm import tqdm

from ..config import SourceConfig
from ..data.chat import render_prompt
from ..data.formats import load_source
from ..drafter import load_drafter
from ..errors import ConfigError
from ..evaluate.decoder import (SpecConfig, estimated_speedup, lookup_generate, speculative_generate,
                                target_generate)
from ..families import text_config
from ..io import write_json_atomic
from ..records import SkipCounter
from ..summaries import EvaluateSummary
from ..targets.load import load_target, load_target_head, materialize_target, read_target_config
from . import RunContext

# tokenize.chat_template_kwargs: prompts are rendered as the target is served and as the drafter was trained
READS = ("evaluate", "target", "tokenize.chat_template_kwargs")
INPUTS = ("export",)


def load_sets(ctx: RunContext) -> dict[str, list[tuple[str, list[str]]]]:
    """set name -> [(conversation id, user turns)] from ``evaluate.prompts`` and ``evaluate.benchmarks``."""
    cfg = ctx.cfg.evaluate
    sets: dict[str, list[tuple[str, list[str]]]] = {}
    specs = [("held_out", src, cfg.max_prompts, "first") for src in cfg.prompts]
    specs += [(b.name, SourceConfig(path=b.path, format=b.format), b.max_prompts, b.turns) for b in cfg.benchmarks]
    for name, src, limit, turns in specs:
        rows = sets.setdefault(name, [])
        for conv in load_source(src, SkipCounter(), {}):
            users = [m.content for m in conv.messages if m.role == "user"]
            if users and (limit is None or len(rows) < limit):
                rows.append((conv.id, users[:1] if turns == "first" else users))
    if not any(sets.values()):
        raise ConfigError("evaluate.prompts and evaluate.benchmarks are empty: give at least one prompt set")
    return sets


def check_config(ctx: RunContext) -> None:
    """Run before ``eyas run``'s first stage: the prompt sets exist and are not empty (raises
    :class:`~eyas.errors.ConfigError`, or the reader's error naming the file), so a long run does not end there."""
    load_sets(ctx)


def spec_config(ctx: RunContext) -> SpecConfig:
    cfg = ctx.cfg.evaluate
    return SpecConfig(depth=cfg.num_draft_tokens, topk=cfg.topk, total_tokens=cfg.total_tokens,
                      temperature=cfg.temperature, seed=cfg.seed)


def run(ctx: RunContext) -> EvaluateSummary:
    cfg = ctx.cfg.evaluate
    sets = load_sets(ctx)
    folder = ctx.run.export("sglang") if ctx.run.export("sglang").exists() else ctx.run.export("vllm")
    if cfg.engine == "vllm":
        per_set = _evaluate_vllm(ctx, sets, folder)
    else:
        per_set = _evaluate_reference(ctx, sets, folder)
    rounds = sum(s["rounds"] for s in per_set.values())
    accepted = sum(s["accepted"] for s in per_set.values())
    per_pos = [sum(s["accepted_per_pos"][i] for s in per_set.values()) for i in range(cfg.num_draft_tokens)]
    checked = [s["lossless_mismatches"] for s in per_set.values() if s.get("lossless_mismatches") is not None]
    result = {
        "engine": cfg.engine, "draft_folder": str(folder),
        "prompts": sum(s["prompts"] for s in per_set.values()),
        "num_draft_tokens": cfg.num_draft_tokens, "topk": cfg.topk, "temperature": cfg.temperature,
        "acceptance_length": round((rounds + accepted) / max(rounds, 1), 4),
        "acceptance_rate_per_position": [round(a / max(rounds, 1), 4) for a in per_pos],
        "rounds": rounds,
        "lossless_checked": bool(checked),
        "lossless_mismatches": sum(checked) if checked else None,
        "sets": per_set,
    }
    times = [s for s in per_set.values() if s.get("target_step_seconds")]
    if times:
        result["speedup_estimate"] = round(sum(s["speedup_estimate"] * s["rounds"] for s in times)
                                           / max(sum(s["rounds"] for s in times), 1), 3)
    base = [s["ngram"] for s in per_set.values() if s.get("ngram")]
    if base:
        result["ngram_tokens_per_target_step"] = round(
            sum(b["tokens_per_target_step"] * b["rounds"] for b in base) / max(sum(b["rounds"] for b in base), 1), 4)
        result["tokens_per_target_step"] = round(
            sum(s["tokens_per_target_step"] * s["rounds"] for s in per_set.values())
            / max(sum(s["rounds"] for s in per_set.values()), 1), 4)
    write_json_atomic(ctx.run.evaluation, result)
    for name, s in per_set.items():
        ng = s.get("ngram")
        ctx.log(f"[eyas] evaluate [{cfg.engine}] {name}: acceptance length {s['acceptance_length']:.3f} "
                f"({s['prompts']} prompts, {s['rounds']} rounds); tokens per target step: drafter "
                f"{s['tokens_per_target_step']:.3f}" + (f", n-gram lookup (no training) "
                                                         f"{ng['tokens_per_target_step']:.3f}" if ng else ""))
    return EvaluateSummary.model_validate({k: v for k, v in result.items() if k != "sets"} | {
        "sets": {n: {k: v for k, v in s.items() if k != "per_prompt"} for n, s in per_set.items()}})


def _set_summary(rounds: int, accepted: int, per_pos: list[int], **extra) -> dict:
    """A set's counts. ``tokens_per_target_step``: new tokens per target forward pass over every verify step
    (prefills excluded); for the reference decoder that is the acceptance length, with vLLM it also counts the
    steps that had no draft."""
    out = {"rounds": rounds, "accepted": accepted, "accepted_per_pos": per_pos,
           "acceptance_length": round((rounds + accepted) / max(rounds, 1), 4),
           "acceptance_rate_per_position": [round(a / max(rounds, 1), 4) for a in per_pos]}
    out["tokens_per_target_step"] = out["acceptance_length"]
    out.update(extra)
    return out


def _evaluate_reference(ctx: RunContext, sets: dict, folder) -> dict:
    cfg = ctx.cfg.evaluate
    spec = spec_config(ctx)
    target = load_target(ctx.cfg.target)
    tok = target.tokenizer
    embed, _ = load_target_head(ctx.cfg.target)
    draft, dcfg = load_drafter(folder, embed, num_target_layers=target.num_layers)   # as vLLM reads the folder
    layer_ids = dcfg.layer_ids("output_of_layer")
    draft.to(target.device)
    eos = model_eos_ids(target, tok)
    greedy = spec.temperature == 0
    out = {}
    for name, convs in sets.items():
        rounds = accepted = mismatches = 0
        per_pos = [0] * spec.depth
        t_draft = t_target = 0.0
        steps: list[float] = []
        per_prompt = []
        ng_rounds = ng_accepted = 0
        ng_pos = [0] * spec.depth
        for sid, turns in tqdm(convs, desc=f"evaluate {name}", unit="prompt", dynamic_ncols=True):
            history = []
            for turn, text in enumerate(turns):
                history.append({"role": "user", "content": text})
                ids = tok(render_prompt(tok, history, chat_template_kwargs=ctx.cfg.tokenize.chat_template_kwargs),
                          add_special_tokens=False).input_ids
                st = speculative_generate(target.model, draft, ids, layer_ids, spec, cfg.max_new_tokens, eos)
                same = None
                if cfg.check_lossless:
                    base = target_generate(target.model, ids, cfg.max_new_tokens, eos, spec.temperature, spec.seed)
                    steps += base.step_seconds
                    if greedy:
                        same = base.tokens == st.tokens
                        mismatches += not same
                if cfg.baseline and greedy:
                    ng = lookup_generate(target.model, ids, spec.depth, cfg.max_new_tokens, eos)
                    ng_rounds, ng_accepted = ng_rounds + ng.rounds, ng_accepted + ng.accepted
                    ng_pos = [a + b for a, b in zip(ng_pos, ng.accepted_per_pos)]
                history.append({"role": "assistant", "content": tok.decode(st.tokens, skip_special_tokens=True)})
                rounds += st.rounds
                accepted += st.accepted
                per_pos = [a + b for a, b in zip(per_pos, st.accepted_per_pos)]
                t_draft += st.draft_seconds
                t_target += st.target_seconds
                per_prompt.append({"id": sid, "turn": turn + 1, "new_tokens": len(st.tokens), "rounds": st.rounds,
                                   "acceptance_length": round(st.acceptance_length, 4), "lossless": same})
        s = _set_summary(rounds, accepted, per_pos, prompts=len(convs), turns=len(per_prompt),
                         lossless_mismatches=mismatches if cfg.check_lossless and greedy else None,
                         draft_seconds_per_round=round(t_draft / max(rounds, 1), 6),
                         verify_seconds_per_round=round(t_target / max(rounds, 1), 6), per_prompt=per_prompt)
        if ng_rounds:
            s["ngram"] = _set_summary(ng_rounds, ng_accepted, ng_pos, prompts=len(convs), turns=len(per_prompt),
                                      lossless_mismatches=None, method="prompt lookup, n 2..4")
        if steps:
            s["target_step_seconds"] = round(sum(steps) / len(steps), 6)
            s["speedup_estimate"] = round(estimated_speedup(s["acceptance_length"], s["draft_seconds_per_round"],
                                                            s["verify_seconds_per_round"], s["target_step_seconds"]), 3)
        out[name] = s
    return out


def _evaluate_vllm(ctx: RunContext, sets: dict, folder) -> dict:
    from transformers import GenerationConfig

    from ..evaluate.vllm_engine import run_vllm
    from ..targets.load import load_tokenizer

    cfg = ctx.cfg.evaluate
    if cfg.topk != 1:
        raise ConfigError("evaluate.engine=vllm drafts chains only: set evaluate.topk=1")
    tcfg = read_target_config(ctx.cfg.target)
    tok = load_tokenizer(ctx.cfg.target)
    tdir = materialize_target(ctx.cfg.target)
    eos = GenerationConfig.from_pretrained(tdir).eos_token_id if (tdir / "generation_config.json").exists() else None
    eos_ids = sorted({*(eos if isinstance(eos, list) else [eos]), tok.eos_token_id} - {None})   # as model_eos_ids
    common = dict(num_speculative_tokens=cfg.num_draft_tokens, max_new_tokens=cfg.max_new_tokens, eos_ids=eos_ids,
                  dtype=ctx.cfg.target.dtype, temperature=cfg.temperature, seed=cfg.seed,
                  chat_template_kwargs=ctx.cfg.tokenize.chat_template_kwargs,
                  max_model_len=target_context(tcfg))
    texts = {n: [t for _, t in convs] for n, convs in sets.items()}
    res = run_vllm(tdir, folder, texts, **common)
    base = run_vllm(tdir, None, texts, method="ngram", **common) if cfg.baseline else {}

    def summary(r: dict, n: str, **extra) -> dict:
        s = _set_summary(r["drafts"], r["accepted"], r["accepted_per_pos"], prompts=len(sets[n]),
                         turns=r["requests"], generated=r["generated"], vllm_seconds=round(r["seconds"], 2), **extra)
        s["tokens_per_target_step"] = round(r["tokens_per_target_forward"], 4)   # every decode step counted
        return s

    out = {}
    for n, r in res.items():
        out[n] = summary(r, n, lossless_mismatches=None)
        if n in base:
            out[n]["ngram"] = summary(base[n], n, lossless_mismatches=None,
                                      method="vLLM ngram, prompt_lookup_min 2, max 4")
            if cfg.temperature == 0:
                out[n]["same_output_as_ngram"] = base[n]["outputs"] == r["outputs"]
    return out


def target_context(target_cfg: dict) -> int:
    """The context vLLM is asked to serve: the target's own ``max_position_embeddings`` (vLLM refuses a
    ``max_model_len`` above it, so a fixed 2,048 refused stories260K's 512)."""
    return int(text_config(target_cfg).get("max_position_embeddings") or 2048)


def model_eos_ids(target, tok) -> set[int]:
    """End-of-turn ids: the generation config's eos ids plus the tokenizer's eos."""
    eos = target.model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return ids
