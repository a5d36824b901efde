"""Teacher-forced step-0 accuracy of drafters on the tokens an engine actually emitted (CPU), split by whether a
reference drafter's draft vocabulary holds the token: what a wider vocabulary could buy, and what it did buy.

    python bench/teacher_forced.py --target TARGET_DIR --outputs RUN.json \
        --drafter committed=bench/results/headline/drafter --drafter new=DIR [--prompts mt_bench.jsonl]

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
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="the target's Hugging Face folder")
    ap.add_argument("--outputs", required=True, help="a bench/vllm_accept.py --json file")
    ap.add_argument("--prompts", default=str(REPO.parent / "shared" / "data" / "eval" / "mt_bench.jsonl"))
    ap.add_argument("--drafter", action="append", required=True, help="NAME=FOLDER (SGLang layout); first: reference")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eyas.drafter import load_drafter
    from vllm_accept import prompts_of

    tok = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    n_layers = target.config.num_hidden_layers
    embed = target.get_input_embeddings().weight.detach()
    outs = json.loads(Path(args.outputs).read_text())["results"][0]["outputs"]
    outs = json.loads(outs) if isinstance(outs, str) else outs
    prompts, _ = prompts_of(Path(args.prompts), tok, len(outs))
    drafters = {}
    for item in args.drafter:
        name, _, folder = item.partition("=")
        drafters[name] = load_drafter(Path(folder), embed, engine="sglang", num_target_layers=n_layers)
    ref = next(iter(drafters.values()))[0]
    ref_ids = set((ref.d2t + torch.arange(len(ref.d2t))).tolist())
    layers = next(iter(drafters.values()))[1].layer_ids("hf_index")   # hidden_states[i]: output of layer i - 1
    hits = {n: {"in": [0, 0], "outside": [0, 0]} for n in drafters}
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            ids = torch.tensor([p + o])
            hs = target(ids, output_hidden_states=True).hidden_states
            aux = torch.cat([hs[i] for i in layers], -1).to(torch.bfloat16).float()
            for name, (m, _) in drafters.items():
                pred = m.logits(m(ids, aux, ttt_steps=1)[0]).argmax(-1)[0]
                pred = pred + m.d2t[pred]                                  # draft id -> target id
                for t in range(len(p) - 1, ids.shape[1] - 2):
                    y = int(ids[0, t + 2])
                    h = hits[name]["in" if y in ref_ids else "outside"]
                    h[0] += int(pred[t] == y)
                    h[1] += 1
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
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
