"""evaluate: acceptance length of the exported drafter on held-out prompts, with the reference decoder.

The drafter is loaded from the exported SGLang folder (what an engine loads), so the evaluation also proves the
export. Each prompt is decoded with chain speculative decoding (greedy) and, with ``check_lossless``, compared
token for token with the target's own greedy output. Writes ``evaluate/results.json``.
"""

from __future__ import annotations

from tqdm import tqdm

from ..data.chat import render_prompt
from ..data.formats import load_source
from ..errors import ConfigError
from ..evaluate.decoder import speculative_generate, target_greedy
from ..export.sglang import load_sglang_draft
from ..io import write_json_atomic
from ..records import SkipCounter
from ..targets.load import load_target, load_target_head
from . import RunContext


def run(ctx: RunContext) -> dict:
    cfg = ctx.cfg.evaluate
    if not cfg.prompts:
        raise ConfigError("evaluate.prompts is empty: give at least one held-out prompt file")
    target = load_target(ctx.cfg.target)
    tok = target.tokenizer
    embed, _ = load_target_head(ctx.cfg.target)
    draft, layer_ids = load_sglang_draft(ctx.stage_dir("export") / "sglang", embed)
    draft.to(target.device)
    skips = SkipCounter()
    prompts = []
    for src in cfg.prompts:
        for conv in load_source(src, skips, {}):
            first_user = next(i for i, m in enumerate(conv.messages) if m.role == "user")
            prompts.append((conv.id, conv.chat_messages()[: first_user + 1]))
    prompts = prompts[: cfg.max_prompts] if cfg.max_prompts else prompts
    eos = model_eos_ids(target, tok)
    per_prompt = []
    rounds = accepted = mismatches = 0
    per_pos = [0] * cfg.num_draft_tokens
    t_target = t_draft = 0.0
    for sid, msgs in tqdm(prompts, desc="evaluate", unit="prompt", dynamic_ncols=True):
        text = render_prompt(tok, msgs, chat_template_kwargs=ctx.cfg.tokenize.chat_template_kwargs)
        ids = tok(text, add_special_tokens=False).input_ids
        st = speculative_generate(target.model, draft, ids, layer_ids, cfg.num_draft_tokens, cfg.max_new_tokens, eos)
        same = None
        if cfg.check_lossless:
            ref = target_greedy(target.model, ids, cfg.max_new_tokens, eos)
            same = ref == st.tokens
            mismatches += not same
        rounds += st.rounds
        accepted += st.accepted
        per_pos = [a + b for a, b in zip(per_pos, st.accepted_per_pos)]
        t_target += st.target_seconds
        t_draft += st.draft_seconds
        per_prompt.append({"id": sid, "new_tokens": len(st.tokens), "rounds": st.rounds,
                           "acceptance_length": round(st.acceptance_length, 4), "lossless": same})
    result = {
        "prompts": len(prompts),
        "num_draft_tokens": cfg.num_draft_tokens,
        "acceptance_length": round((rounds + accepted) / max(rounds, 1), 4),
        "acceptance_rate_per_position": [round(a / max(rounds, 1), 4) for a in per_pos],
        "rounds": rounds,
        "lossless_checked": cfg.check_lossless,
        "lossless_mismatches": mismatches if cfg.check_lossless else None,
        "target_seconds": round(t_target, 2),
        "draft_seconds": round(t_draft, 2),
        "per_prompt": per_prompt,
    }
    write_json_atomic(ctx.stage_dir("evaluate") / "results.json", result)
    ctx.log(f"[eyas] evaluate: acceptance length {result['acceptance_length']:.3f} "
            f"(k={cfg.num_draft_tokens}, {len(prompts)} prompts, lossless mismatches: {mismatches})")
    return {k: v for k, v in result.items() if k != "per_prompt"}


def model_eos_ids(target, tok) -> set[int]:
    """End-of-turn ids: the generation config's eos ids plus the tokenizer's eos."""
    eos = target.model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return ids
