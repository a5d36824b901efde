"""evaluate: acceptance length of the exported drafter per prompt set, by the reference decoder or by vLLM.

Sets: ``evaluate.prompts`` (one set, ``held_out``) and ``evaluate.benchmarks`` (named sets: MT-bench with both
turns, HumanEval, GSM8K, any JSONL of prompts). Every user turn of a conversation is decoded in order, the model's
own reply going into the next turn's prompt.

- ``engine: reference``: :mod:`eyas.evaluate.decoder` (chain or tree, greedy or sampling) on the exported folder
  (what an engine loads, so evaluation also proves the export). Greedy runs are checked against the target's own
  decoding (``check_lossless``; :func:`~eyas.evaluate.decoder.check_greedy`: token for token, or parted only at a
  near-tie within the target's numeric noise, as bf16 does), which also times plain target steps for the speedup
  estimate.
- ``engine: vllm``: vLLM serves the target with the exported folder and reports acceptance from its own counters
  (:mod:`eyas.evaluate.vllm_engine`; chain drafting only).

Baselines that need no training run on the same prompts (``evaluate.baseline``): n-gram prompt lookup (both engines)
and suffix decoding (vLLM ``method: suffix``, arctic-inference). A set whose rows carry ``evaluate.category_field``
(MT-bench's eight categories) is also reported per category, drafter beside each baseline
(:func:`category_summaries`), and the summary names the categories where the drafter's tokens per target step are
below ``evaluate.ngram_margin`` times n-gram lookup's.

Writes ``evaluate/results.json`` (per set, per category and overall; per prompt for the reference decoder, per
conversation for vLLM).
"""

from __future__ import annotations

from tqdm import tqdm

from ..config import SourceConfig
from ..data.chat import render_prompt
from ..data.formats import load_source, source_rows
from ..drafter import load_drafter
from ..errors import ConfigError
from ..evaluate.decoder import (LOSSLESS_STATUSES, SpecConfig, check_greedy, estimated_speedup, lookup_generate,
                                speculative_generate, target_generate)
from ..families import text_config
from ..io import write_json_atomic
from ..records import SkipCounter
from ..summaries import EvaluateSummary
from ..targets.load import load_target, load_target_head, materialize_target, read_target_config
from . import RunContext

# tokenize.chat_template_kwargs: prompts are rendered as the target is served and as the drafter was trained
READS = ("evaluate", "target", "tokenize.chat_template_kwargs")
INPUTS = ("export",)
# The drafting methods that need no training (evaluate.baseline): the key each one's counts go under in a summary
BASELINES = ("ngram", "suffix")


def reads_target_weights(cfg) -> bool:
    """Both engines run the target from its folder (the reference decoder and vLLM)."""
    return True


def load_sets(ctx: RunContext) -> dict[str, list[tuple[str, list[str]]]]:
    """set name -> [(conversation id, user turns)] from ``evaluate.prompts`` and ``evaluate.benchmarks``."""
    return {name: [(cid, turns) for cid, turns, _ in rows] for name, rows in _read_sets(ctx).items()}


def load_categories(ctx: RunContext) -> dict[str, dict[str, str]]:
    """set name -> {conversation id -> category} for the conversations of :func:`load_sets` whose row carries
    ``evaluate.category_field`` (MT-bench: ``category``, eight of them); a set without any is absent, and so is
    everything when the field is null."""
    out: dict[str, dict[str, str]] = {}
    for name, rows in _read_sets(ctx).items():
        cats = {cid: cat for cid, _, cat in reversed(rows) if cat is not None}   # reversed: the first row wins
        if cats:
            out[name] = cats
    return out


def _read_sets(ctx: RunContext) -> dict[str, list[tuple[str, list[str], str | None]]]:
    """set name -> [(conversation id, user turns, category or None)]; raises :class:`ConfigError` when every set
    is empty (or the reader's error naming the file)."""
    cfg = ctx.cfg.evaluate
    sets: dict[str, list[tuple[str, list[str], str | None]]] = {}
    specs = [("held_out", src, cfg.max_prompts, "first") for src in cfg.prompts]
    specs += [(b.name, SourceConfig(path=b.path, format=b.format), b.max_prompts, b.turns) for b in cfg.benchmarks]
    for name, src, limit, turns in specs:
        rows = sets.setdefault(name, [])
        cats = row_field_by_location(src, cfg.category_field) if cfg.category_field else {}
        for conv in load_source(src, SkipCounter(), {}):
            users = [m.content for m in conv.messages if m.role == "user"]
            if users and (limit is None or len(rows) < limit):
                rows.append((conv.id, users[:1] if turns == "first" else users, cats.get(conv.source)))
    if not any(sets.values()):
        raise ConfigError("evaluate.prompts and evaluate.benchmarks are empty: give at least one prompt set")
    return sets


def row_field_by_location(src: SourceConfig, field: str) -> dict[str, str]:
    """Row location (``file:line``, the :attr:`~eyas.records.Conversation.source` that ``load_source`` gives each
    conversation) -> that raw row's ``field`` as a string, for the rows of ``src`` that have it (not empty).

    The normalised conversation keeps only turns, so evaluate reads a row's category here, from the same file with
    the same row reader (:func:`~eyas.data.formats.source_rows`), and joins on the location.
    A row whose location does not match is simply without a category."""
    out = {}
    for raw, _ in source_rows(src):
        value = raw.data.get(field) if raw is not None and isinstance(raw.data, dict) else None
        if value is not None and str(value).strip():
            out[raw.where] = str(value).strip()
    return out


def check_config(ctx: RunContext) -> None:
    """Run before ``eyas run``'s first stage: the prompt sets exist and are not empty (raises
    :class:`~eyas.errors.ConfigError`, or the reader's error naming the file), so a long run does not end there."""
    load_sets(ctx)
    if "suffix" in ctx.cfg.evaluate.baseline and ctx.cfg.evaluate.engine != "vllm":
        raise ConfigError("evaluate.baseline 'suffix' (suffix decoding) is measured by vLLM only: set "
                          "evaluate.engine=vllm, or leave 'suffix' out of evaluate.baseline")


def spec_config(ctx: RunContext) -> SpecConfig:
    cfg = ctx.cfg.evaluate
    return SpecConfig(depth=cfg.num_draft_tokens, topk=cfg.topk, total_tokens=cfg.total_tokens,
                      temperature=cfg.temperature, seed=cfg.seed)


def run(ctx: RunContext) -> EvaluateSummary:
    cfg = ctx.cfg.evaluate
    check_config(ctx)
    sets = load_sets(ctx)
    folder = ctx.run.export("sglang") if ctx.run.export("sglang").exists() else ctx.run.export("vllm")
    if cfg.engine == "vllm":
        per_set = _evaluate_vllm(ctx, sets, folder)
    else:
        per_set = _evaluate_reference(ctx, sets, folder)
    below = add_categories(per_set, load_categories(ctx) if cfg.category_field else {}, cfg.ngram_margin)
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
        "lossless_near_ties": (sum(s.get("lossless_near_ties") or 0 for s in per_set.values()) if checked
                               else None),
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
    suffix = [s["suffix"] for s in per_set.values() if s.get("suffix")]
    if suffix:
        result["suffix_tokens_per_target_step"] = round(
            sum(b["tokens_per_target_step"] * b["rounds"] for b in suffix) / max(sum(b["rounds"] for b in suffix), 1), 4)
    if below is not None:
        result["ngram_margin"] = cfg.ngram_margin
        result["categories_below_ngram_margin"] = below
    write_json_atomic(ctx.run.evaluation, result)
    for name, s in per_set.items():
        ng, sx = s.get("ngram"), s.get("suffix")
        ctx.log(f"[eyas] evaluate [{cfg.engine}] {name}: acceptance length {s['acceptance_length']:.3f} "
                f"({s['prompts']} prompts, {s['rounds']} rounds); tokens per target step: drafter "
                f"{s['tokens_per_target_step']:.3f}" + (f", n-gram lookup (no training) "
                                                         f"{ng['tokens_per_target_step']:.3f}" if ng else "")
                + (f", suffix decoding {sx['tokens_per_target_step']:.3f}" if sx else ""))
        for line in category_lines(name, s):
            ctx.log(f"[eyas] evaluate [{cfg.engine}]   {line}")
    if below is not None:
        gains = {f"{n}/{c}": cs["gain_over_ngram"] for n, s in per_set.items()
                 for c, cs in (s.get("categories") or {}).items()}
        ctx.log(f"[eyas] evaluate: categories where the drafter is below {cfg.ngram_margin:g}x n-gram lookup's tokens "
                f"per target step: " + (", ".join(f"{n} ({gains[n]:.2f}x)" for n in below) if below else "none"))
    return EvaluateSummary.model_validate({k: v for k, v in result.items() if k != "sets"} | {
        "sets": {n: {k: v for k, v in s.items() if k not in ("per_prompt", "per_conversation")}
                 for n, s in per_set.items()}})


def add_categories(per_set: dict, categories: dict[str, dict[str, str]], margin: float) -> list[str] | None:
    """Add ``categories`` (:func:`category_summaries`) to each set of ``per_set`` that has categorised conversations,
    and ``gain_over_ngram`` to each set and category measured beside n-gram lookup.

    ``per_set``: set name -> its summary with ``per_prompt`` (reference decoder) or ``per_conversation`` (vLLM) rows;
    ``categories``: :func:`load_categories`. Returns the names ``set/category`` whose ``gain_over_ngram`` is below
    ``margin``, worst first, or None when no category was measured beside n-gram lookup."""
    below: list[tuple[float, str]] = []
    measured = False
    for name, s in per_set.items():
        for m in BASELINES:
            if s.get(m):
                s[f"gain_over_{m}"] = _gain(s, s[m])
        rows = s.get("per_prompt") or s.get("per_conversation") or []
        if name not in categories or not rows:
            continue
        s["categories"] = category_summaries(rows, categories[name])
        for cat, c in s["categories"].items():
            if c.get("gain_over_ngram") is not None:
                measured = True
                if c["gain_over_ngram"] < margin:
                    below.append((c["gain_over_ngram"], f"{name}/{cat}"))
    return [n for _, n in sorted(below)] if measured else None


def category_summaries(rows: list[dict], categories: dict[str, str]) -> dict[str, dict]:
    """One set's figures per category, pooled over its rows as the set's own figures are.

    ``rows``: the set's per-prompt counts (reference decoder, one per turn) or per-conversation counts (vLLM), each
    ``{"id", "rounds", "accepted", "accepted_per_pos" [k]}`` and optionally ``turns`` (default 1),
    ``decode_tokens``/``decode_steps`` (new tokens and target forward passes over every decode step, prefills
    excluded; default ``rounds + accepted`` and ``rounds``), and ``ngram``/``suffix`` (n-gram lookup's, suffix
    decoding's counts on the same prompt, the same keys). ``categories``: conversation id -> category; rows of
    other ids are left out.

    Returns category (sorted) -> a set summary (:func:`_set_summary`; ``prompts`` counts distinct conversations)
    whose ``tokens_per_target_step`` is ``sum(decode_tokens) / sum(decode_steps)``, with ``ngram`` and
    ``gain_over_ngram`` (drafter's tokens per target step / n-gram's) where every row has n-gram counts (and
    ``suffix``, ``gain_over_suffix`` likewise)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r["id"] in categories:
            groups.setdefault(categories[r["id"]], []).append(r)
    out = {}
    for cat in sorted(groups):
        g = groups[cat]
        extra = dict(prompts=len({r["id"] for r in g}), turns=sum(r.get("turns", 1) for r in g),
                     lossless_mismatches=None)
        s = _pooled(g, **extra)
        for m in BASELINES:
            if all(r.get(m) for r in g):
                s[m] = _pooled([r[m] for r in g], **extra)
                s[f"gain_over_{m}"] = _gain(s, s[m])
        out[cat] = s
    return out


def _pooled(rows: list[dict], **extra) -> dict:
    """:func:`_set_summary` of rows' summed counts; tokens per target step over every decode step (see
    :func:`category_summaries`)."""
    k = max(len(r["accepted_per_pos"]) for r in rows)
    per_pos = [sum(r["accepted_per_pos"][i] for r in rows if i < len(r["accepted_per_pos"])) for i in range(k)]
    s = _set_summary(sum(r["rounds"] for r in rows), sum(r["accepted"] for r in rows), per_pos, **extra)
    tokens = sum(r.get("decode_tokens", r["rounds"] + r["accepted"]) for r in rows)
    steps = sum(r.get("decode_steps", r["rounds"]) for r in rows)
    s["tokens_per_target_step"] = round(tokens / max(steps, 1), 4)
    return s


def _gain(drafter: dict, baseline: dict) -> float:
    """Drafter's tokens per target step over a baseline's (both counted over every decode step)."""
    return round(drafter["tokens_per_target_step"] / max(baseline["tokens_per_target_step"], 1e-9), 4)


def category_lines(name: str, s: dict) -> list[str]:
    """One log line per category of set ``name``'s summary ``s``: acceptance length, tokens per target step of the
    drafter and of n-gram lookup, and their ratio."""
    lines = []
    for cat, c in (s.get("categories") or {}).items():
        ng, sx = c.get("ngram"), c.get("suffix")
        lines.append(f"{name}/{cat}: acceptance length {c['acceptance_length']:.3f} ({c['prompts']} prompts, "
                     f"{c['rounds']} rounds); tokens per target step: drafter {c['tokens_per_target_step']:.3f}"
                     + (f", n-gram {ng['tokens_per_target_step']:.3f} ({c['gain_over_ngram']:.2f}x)" if ng else "")
                     + (f", suffix {sx['tokens_per_target_step']:.3f} ({c['gain_over_suffix']:.2f}x)" if sx else ""))
    return lines


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


def _lossless_counts(verdicts: dict[str, int] | None) -> dict:
    """A set's lossless counts from {status: prompts} (:data:`~eyas.evaluate.decoder.LOSSLESS_STATUSES`), None when
    unchecked: ``lossless_mismatches`` the prompts that failed (a token the target would not have chosen; the check
    passes when it is 0), ``lossless_near_ties`` those whose output parted from the target's only at a near-tie
    within the numeric noise (bf16), ``lossless_passed`` those token for token equal."""
    if verdicts is None:
        return {"lossless_mismatches": None}
    return {"lossless_mismatches": verdicts["failed"], "lossless_near_ties": verdicts["parted_at_near_tie"],
            "lossless_passed": verdicts["passed"]}


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
        rounds = accepted = 0
        verdicts = dict.fromkeys(LOSSLESS_STATUSES, 0)      # prompts per lossless status (greedy, checked)
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
                verdict = None
                if cfg.check_lossless:
                    base = target_generate(target.model, ids, cfg.max_new_tokens, eos, spec.temperature, spec.seed,
                                           reference=st.tokens if greedy else None)
                    steps += base.step_seconds
                    if greedy:      # bf16 outputs may part at a near-tie: check_greedy says whether that is all
                        verdict = check_greedy(target.model, ids, base, st.tokens)
                        verdicts[verdict.status] += 1
                if "ngram" in cfg.baseline and greedy:
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
                                   "accepted": st.accepted, "accepted_per_pos": list(st.accepted_per_pos),
                                   "acceptance_length": round(st.acceptance_length, 4),
                                   "lossless": verdict.to_json() if verdict else None})
                if "ngram" in cfg.baseline and greedy:   # the same turn's n-gram counts, for the category figures
                    per_prompt[-1]["ngram"] = {"rounds": ng.rounds, "accepted": ng.accepted,
                                               "accepted_per_pos": list(ng.accepted_per_pos)}
        s = _set_summary(rounds, accepted, per_pos, prompts=len(convs), turns=len(per_prompt),
                         **_lossless_counts(verdicts if cfg.check_lossless and greedy else None),
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


# vLLM's drafting methods that need no training, as run_vllm configures them (vllm/config/speculative.py defaults)
VLLM_BASELINES = {"ngram": "vLLM ngram, prompt_lookup_min 2, max 4",
                  "suffix": "vLLM suffix (arctic-inference), max tree depth 24, spec factor 1.0, min token prob 0.1"}


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
    base = {m: run_vllm(tdir, None, texts, method=m, **common) for m in cfg.baseline}   # one engine each

    def summary(r: dict, n: str, **extra) -> dict:
        s = _set_summary(r["drafts"], r["accepted"], r["accepted_per_pos"], prompts=len(sets[n]),
                         turns=r["requests"], generated=r["generated"], vllm_seconds=round(r["seconds"], 2), **extra)
        s["tokens_per_target_step"] = round(r["tokens_per_target_forward"], 4)   # every decode step counted
        return s

    out = {}
    for n, r in res.items():
        out[n] = summary(r, n, lossless_mismatches=None)
        out[n]["per_conversation"] = [{"id": cid, **_conversation_counts(c)}
                                      for (cid, _), c in zip(sets[n], r["per_conversation"])]
        for m, b in base.items():
            out[n][m] = summary(b[n], n, lossless_mismatches=None, method=VLLM_BASELINES[m])
            for row, c in zip(out[n]["per_conversation"], b[n]["per_conversation"]):
                row[m] = _conversation_counts(c)
            if cfg.temperature == 0:
                out[n][f"same_output_as_{m}"] = b[n]["outputs"] == r["outputs"]
    return out


def _conversation_counts(c: dict) -> dict:
    """A conversation's counts from vLLM's per-request metrics (:func:`eyas.evaluate.vllm_engine.run_vllm`) in the
    keys :func:`category_summaries` reads: rounds = verify steps with a draft; decode tokens and steps count every
    decode step (a request's prefill gives its first token, as ``tokens_per_target_forward`` counts)."""
    tokens = c["generated"] - c["requests"]
    return {"turns": c["requests"], "rounds": c["drafts"], "accepted": c["accepted"],
            "accepted_per_pos": c["accepted_per_pos"], "decode_tokens": tokens, "decode_steps": tokens - c["accepted"]}


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
