"""Teacher-forced step-0 accuracy of drafters on the tokens an engine actually emitted (CPU), split by whether a
reference drafter's draft vocabulary holds the token: what a wider vocabulary could buy, and what it did buy.
With ``--chain K``, the engine's chain decoding replayed over the same tokens: tokens per target forward and
acceptance per position, as ``bench/vllm_accept.py`` counts them, from the drafter's own TTT steps (a figure for a
drafter vLLM has not served, in a minute a set; the engine's greedy text does not depend on the drafter).
With ``--conversations FILE --source S``, the text is instead the first reply of ``--n`` conversations of a
generate stage's ``conversations.jsonl[.xz]`` whose source contains S (seeded pick, the reply tokenized and cut at
``--max-new-tokens``): the same figures on training-like text, to tell a domain gap from a hard domain.

    python bench/teacher_forced.py --target TARGET_DIR --outputs RUN.json \
        --drafter committed=bench/results/headline/drafter --drafter new=DIR [--prompts mt_bench.jsonl] [--chain 3]

``--outputs``: a ``bench/vllm_accept.py --json`` file; its first method's greedy outputs (token ids) are the text,
each after its prompt rendered as ``vllm_accept.py`` renders it. The target runs in float32; its aux states are
rounded to bf16, as a store or online training keeps them. At position t the draft's step 0 (the target's states
up to t, the embedding of token t+1) predicts token t+2 (:meth:`eyas.model.eagle3.Eagle3DraftModel.forward`); it
is scored against the emitted token there, over every emitted token but the first two. The first ``--drafter``
is the reference whose vocabulary splits the tokens. Per-token accuracy is higher than an engine's first-position
acceptance, which counts verify steps: a run of easy tokens takes fewer steps than a run of hard ones.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))


CONFIDENCE_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.01)   # buckets of the target's top-1 probability (--confidence)


def replay_chain(steps: list[torch.Tensor], ids: torch.Tensor, prompt_len: int, acc: dict) -> None:
    """Replay greedy chain decoding over one emitted sequence, as an engine counts it.

    ``steps[k][t]``: target id that TTT step k predicts at position t (token t+2+k), teacher-forced on ``ids``
    (int64 [T]: the prompt, then the emitted tokens). The prefill emits the first token (one forward); then, with
    tokens verified up to index n, the drafts are ``steps[k][n-1]`` for k < K, accepted while they match ``ids``,
    and each verify forward emits the accepted drafts plus one token of its own. Adds to ``acc``: ``forwards``,
    ``tokens`` and ``accepted_at[k]`` (verify forwards whose draft k was accepted; the prefill counts as a forward
    that drafted nothing, as vLLM's tokens per target forward counts it)."""
    T, K = len(ids), len(steps)
    n = prompt_len                                                        # index of the prefill's token
    acc["forwards"] += 1
    acc["tokens"] += 1
    while n + 1 < T:
        a = 0
        while a < K and n + 1 + a < T and int(steps[a][n - 1]) == int(ids[n + 1 + a]):
            acc["accepted_at"][a] += 1
            a += 1
        emitted = min(a + 1, T - 1 - n)
        acc["forwards"] += 1
        acc["tokens"] += emitted
        n += emitted


def replies_of(path: Path, source: str, n: int, seed: int, max_new: int, tok) -> tuple[list, list]:
    """Prompt ids (the first user turn, rendered as ``vllm_accept.py`` renders it) and reply ids (the first assistant
    turn, at most ``max_new`` tokens) of ``n`` conversations picked with ``seed`` among the rows of a generate
    stage's conversations file whose ``source`` contains ``source`` and that hold a reply. Raises SystemExit when
    fewer rows match."""
    import lzma
    import random

    from eyas.data.chat import render_prompt

    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt") as f:
        rows = [r for r in map(json.loads, f) if source in r["source"]   # a reply after a user turn
                and any(m["role"] == "assistant" for m in r["messages"][1:])]
    if len(rows) < n:
        raise SystemExit(f"{path}: {len(rows)} rows with source containing {source!r}, {n} asked")
    prompts, outs = [], []
    for r in random.Random(seed).sample(rows, n):
        msgs = r["messages"]
        first = next(i for i, m in enumerate(msgs) if m["role"] == "user")
        reply = next(m["content"] for m in msgs[first:] if m["role"] == "assistant")
        prompts.append(tok(render_prompt(tok, msgs[: first + 1]), add_special_tokens=False).input_ids)
        outs.append(tok(reply, add_special_tokens=False).input_ids[:max_new])
    return prompts, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="the target's Hugging Face folder")
    ap.add_argument("--outputs", help="a bench/vllm_accept.py --json file")
    ap.add_argument("--conversations", help="instead of --outputs: a generate stage's conversations.jsonl[.xz]")
    ap.add_argument("--source", default="", help="with --conversations: rows whose source contains this")
    ap.add_argument("--n", type=int, default=80, help="with --conversations: conversations picked (seeded)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=256, help="with --conversations: reply tokens kept")
    ap.add_argument("--prompts", default=str(REPO.parent / "shared" / "data" / "eval" / "mt_bench.jsonl"))
    ap.add_argument("--drafter", action="append", required=True, help="NAME=FOLDER (SGLang layout); first: reference")
    ap.add_argument("--chain", type=int, default=0, help="also replay chain decoding with K draft tokens over the "
                    "emitted tokens (TTT steps 0..K-1, teacher-forced) and give tokens per target forward")
    ap.add_argument("--confidence", action="store_true",
                    help="also split step-0 accuracy by the target's own top-1 probability for the predicted token "
                         "(where the drafter misses: on tokens the target is sure of, or on near-coin-flips)")
    ap.add_argument("--misses", type=int, default=0,
                    help="also list the N tokens the first drafter misses most often at step 0 where the target is "
                         "sure (top-1 probability 0.9 or more), with what it proposed there")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    if (args.outputs is None) == (args.conversations is None):
        ap.error("give one of --outputs and --conversations")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eyas.data.vocab import draft_to_target_ids
    from eyas.drafter import load_drafter
    from vllm_accept import prompts_of

    tok = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    n_layers = target.config.num_hidden_layers
    embed = target.get_input_embeddings().weight.detach()
    if args.conversations:
        prompts, outs = replies_of(Path(args.conversations), args.source, args.n, args.seed, args.max_new_tokens, tok)
    else:
        outs = json.loads(Path(args.outputs).read_text())["results"][0]["outputs"]
        outs = json.loads(outs) if isinstance(outs, str) else outs
        prompts, _ = prompts_of(Path(args.prompts), tok, len(outs))
    drafters = {}
    for item in args.drafter:
        name, _, folder = item.partition("=")
        drafters[name] = load_drafter(Path(folder), embed, engine="sglang", num_target_layers=n_layers)
    target_ids = {name: draft_to_target_ids(m.d2t) for name, (m, _) in drafters.items()}   # draft id -> target id
    ref_name = next(iter(drafters))
    ref_ids = set(target_ids[ref_name].tolist())
    layers = next(iter(drafters.values()))[1].layer_ids("hf_index")   # hidden_states[i]: output of layer i - 1
    hits = {n: {"in": [0, 0], "outside": [0, 0]} for n in drafters}
    chain = {n: {"forwards": 0, "tokens": 0, "accepted_at": [0] * args.chain} for n in drafters}
    by_conf = {n: [[0, 0] for _ in CONFIDENCE_EDGES[:-1]] for n in drafters}   # [right, tokens] per bucket
    argmax_agree = [0, 0]
    sure_misses: Counter = Counter()   # (emitted, proposed, in the reference vocabulary) -> count (--misses)
    sure_tokens = [0, 0]               # [missed, all] where the target is sure
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            ids = torch.tensor([p + o])
            out = target(ids, output_hidden_states=True)
            aux = torch.cat([out.hidden_states[i] for i in layers], -1).to(torch.bfloat16).float()
            top = out.logits[0].softmax(-1).max(-1)          # the target's own top-1 at each position (fp32)
            if args.confidence:                                # does the emitted token (t+2) agree with it (t+1)?
                span = slice(len(p), ids.shape[1] - 1)
                argmax_agree[0] += int((top.indices[span] == ids[0, span.start + 1:]).sum())
                argmax_agree[1] += span.stop - span.start
            for name, (m, _) in drafters.items():
                steps = [target_ids[name][m.logits(h).argmax(-1)[0]]
                         for h in m(ids, aux, ttt_steps=max(args.chain, 1))]
                pred = steps[0]
                if args.chain:
                    replay_chain(steps, ids[0], len(p), chain[name])
                for t in range(len(p) - 1, ids.shape[1] - 2):
                    y = int(ids[0, t + 2])
                    h = hits[name]["in" if y in ref_ids else "outside"]
                    h[0] += int(pred[t] == y)
                    h[1] += 1
                    if args.misses and name == ref_name and float(top.values[t + 1]) >= 0.9:
                        sure_tokens[1] += 1
                        if int(pred[t]) != y:
                            sure_tokens[0] += 1
                            sure_misses[(tok.decode([y]), tok.decode([int(pred[t])]), y in ref_ids)] += 1
                    if args.confidence:                        # token t+2 is the target's choice at t+1
                        c = float(top.values[t + 1])
                        b = by_conf[name][next(i for i, e in enumerate(CONFIDENCE_EDGES[1:]) if c < e)]
                        b[0] += int(pred[t] == y)
                        b[1] += 1
    res = {}
    for name, h in hits.items():
        right, n = h["in"][0] + h["outside"][0], h["in"][1] + h["outside"][1]
        res[name] = {"accuracy": round(right / n, 4), "tokens": n,
                     "in_reference_vocab": round(h["in"][0] / max(h["in"][1], 1), 4), "in_tokens": h["in"][1],
                     "outside_reference_vocab": round(h["outside"][0] / max(h["outside"][1], 1), 4),
                     "outside_tokens": h["outside"][1]}
        print(f"{name:12s} step-0 accuracy {res[name]['accuracy']:.4f} over {n} tokens; on tokens in the reference "
              f"vocabulary {res[name]['in_reference_vocab']:.4f} ({h['in'][1]}), outside it "
              f"{res[name]['outside_reference_vocab']:.4f} ({h['outside'][1]})")
        if args.chain:
            c = chain[name]
            res[name]["chain"] = {"k": args.chain, "tokens": c["tokens"], "target_forwards": c["forwards"],
                                  "tokens_per_target_forward": round(c["tokens"] / max(c["forwards"], 1), 4),
                                  "accepted_per_position": [round(a / max(c["forwards"], 1), 4)
                                                            for a in c["accepted_at"]]}
            print(f"{name:12s} chain {args.chain}: {res[name]['chain']['tokens_per_target_forward']:.4f} tokens per "
                  f"target forward, accepted per position {res[name]['chain']['accepted_per_position']}")
        if args.confidence:
            n = sum(k for _, k in by_conf[name])
            res[name]["by_target_top1"] = [
                {"from": lo, "to": min(hi, 1.0), "share": round(k / n, 4), "step0_accuracy": round(r / max(k, 1), 4),
                 "misses_of_all": round((k - r) / n, 4)}
                for (r, k), lo, hi in zip(by_conf[name], CONFIDENCE_EDGES, CONFIDENCE_EDGES[1:])]
            for b in res[name]["by_target_top1"]:
                print(f"{name:12s} target top-1 in [{b['from']:.1f}, {b['to']:.1f}): {b['share']:.3f} of tokens, "
                      f"step-0 accuracy {b['step0_accuracy']:.3f}, misses {b['misses_of_all']:.3f} of all")
    if args.confidence:
        res["emitted_is_fp32_argmax"] = round(argmax_agree[0] / max(argmax_agree[1], 1), 4)
        print(f"emitted token = the fp32 target's argmax: {res['emitted_is_fp32_argmax']:.4f}")
    if args.misses:
        top_misses = [{"emitted": e, "proposed": q, "in_reference_vocab": v, "count": k}
                      for (e, q, v), k in sure_misses.most_common(args.misses)]
        res["sure_misses"] = {"tokens_target_sure": sure_tokens[1], "missed": sure_tokens[0],
                              "outside_reference_vocab": sum(k for (_, _, v), k in sure_misses.items() if not v),
                              "top": top_misses}
        print(f"where the target is sure: {sure_tokens[0]} of {sure_tokens[1]} missed, "
              f"{res['sure_misses']['outside_reference_vocab']} of them outside the reference vocabulary")
        for m in top_misses:
            print(f"  {m['count']:4d}  emitted {m['emitted']!r:16s} proposed {m['proposed']!r:16s} "
                  f"{'' if m['in_reference_vocab'] else '(outside the vocabulary)'}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
