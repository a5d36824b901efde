"""The headline run (issue 11): SmolLM2-135M-Instruct drafted on all of ../shared/data/train on one H200, inside one
session's device time, every stage Eyas's own (``python -m eyas.cli STAGE CONFIG``, resumable).

This file only measures around the stages and packs what comes back; bench/headline.sh chains the device calls.

Sub-commands:
    stages         run the named stages in order (each a ``python -m eyas.cli`` process) until a time limit; a
                   stage stopped by the limit resumes on the next call
    extract-ratio  the extract stage on the real tokenized data against plain prefill of the same batches: the
                   base model's forward over the stage's own batch plan (no hooks, nothing copied), timed before
                   and after the stage; ``ratio = stage tokens/s / plain tokens/s``; writes RUNS/extract_ratio.json
    budget         ``train.epochs`` for a given number of training minutes, from the dataset's tokens and the
                   in-loop rate (bench/train_loop.py's SmolLM2 row, corrected for the target's forward in online
                   mode with the prefill rate measured by extract-ratio); writes RUNS/budget.json, whose overrides
                   every later call applies
    evaluate       acceptance per evaluation set (MT-bench first turns, HumanEval, GSM8K test): the reference
                   decoder (eyas.evaluate.decoder) with chain 3 (with the lossless check), chain 7 and an EAGLE
                   tree, and prompt-lookup (n-gram) drafting of 3 tokens, spread over worker processes on the GPU
    pack           OUT/results.tar.gz (run folder without states, checkpoints and weights, plus the JSON results)
                   and the exported SGLang drafter's weight files (each under 16 MiB) beside it
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "bench" / "headline.yaml"
EVAL_SETS = {"mt_bench": ("eval/mt_bench.jsonl", "mt_bench"), "humaneval": ("eval/humaneval.jsonl", "prompts"),
             "gsm8k": ("eval/gsm8k_test.jsonl", "gsm8k")}
T0 = time.time()


def log(msg: str) -> None:
    print(f"[headline {time.strftime('%H:%M:%S')} +{time.time() - T0:.0f}s] {msg}", flush=True)


def overrides(args) -> list[str]:
    out = [f"run_dir={Path(args.runs) / 'headline'}"]
    budget = Path(args.runs) / "budget.json"
    if budget.exists():
        out += json.loads(budget.read_text())["overrides"]
    return out + list(args.set or [])


def load_cfg(args):
    from eyas.config import load_config

    return load_config(args.config, overrides(args))


def left(args) -> float | None:
    return None if args.time_limit is None else args.time_limit - (time.time() - T0)


def cmd_stages(args) -> None:
    for stage in args.stages.split(","):
        remaining = left(args)
        if remaining is not None and remaining < 20:
            log(f"{stage}: not started, time limit reached")
            return
        cmd = [sys.executable, "-m", "eyas.cli", stage, str(args.config), *overrides(args)]
        log(f"eyas {stage}")
        try:
            rc = subprocess.run(cmd, timeout=remaining).returncode
        except subprocess.TimeoutExpired:
            log(f"{stage}: stopped at the time limit; it resumes on the next call")
            return
        log(f"eyas {stage}: exit {rc}")
        if rc != 0:
            raise SystemExit(rc)


def _plain_prefill(model, batches, device) -> tuple[float, int]:
    import torch

    tokens = 0
    torch.cuda.synchronize()
    t = time.perf_counter()
    for b in batches:
        T = max(s.num_tokens for s in b)
        ids = torch.zeros(len(b), T, dtype=torch.long)
        mask = torch.zeros(len(b), T, dtype=torch.long)
        for r, s in enumerate(b):
            ids[r, : s.num_tokens] = torch.tensor(s.input_ids)
            mask[r, : s.num_tokens] = 1
        with torch.no_grad():
            model(input_ids=ids.to(device, non_blocking=True), attention_mask=mask.to(device, non_blocking=True),
                  use_cache=False)
        tokens += sum(s.num_tokens for s in b)
    torch.cuda.synchronize()
    return time.perf_counter() - t, tokens


def cmd_extract_ratio(args) -> None:
    import torch
    from transformers import AutoModel

    from eyas.capture.transformers_backend import DTYPES, resolve_compute_dtype
    from eyas.io import iter_jsonl
    from eyas.records import TokenizedSample
    from eyas.store.extraction import plan_batches
    from eyas.targets.load import materialize_target

    cfg = load_cfg(args)
    run = Path(cfg.run_dir)
    samples = [TokenizedSample.from_json(d) for _, d in iter_jsonl(run / "tokenize" / "samples.jsonl")]
    batches = plan_batches(samples, cfg.extract.batch_tokens)
    dev = torch.device("cuda")
    model = AutoModel.from_pretrained(materialize_target(cfg.target), dtype=DTYPES[
        resolve_compute_dtype(cfg.extract, cfg.target, dev)]).to(dev).eval()
    _plain_prefill(model, batches[:: max(1, len(batches) // 8)], dev)            # warm-up over the shapes
    before, tokens = _plain_prefill(model, batches, dev)
    del model
    torch.cuda.empty_cache()
    t = time.perf_counter()
    cmd_args = argparse.Namespace(**{**vars(args), "stages": "extract", "time_limit": None})
    cmd_stages(cmd_args)
    stage_wall = time.perf_counter() - t
    done = json.loads((run / "extract" / "done.json").read_text())
    model = AutoModel.from_pretrained(materialize_target(cfg.target), dtype=DTYPES[
        resolve_compute_dtype(cfg.extract, cfg.target, dev)]).to(dev).eval()
    after, _ = _plain_prefill(model, batches, dev)
    plain = tokens / ((before + after) / 2)
    stage = done["summary"]["tokens_per_s"]
    res = {"tokens": tokens, "batches": len(batches), "batch_tokens": cfg.extract.batch_tokens,
           "plain_seconds": [round(before, 2), round(after, 2)], "plain_tokens_per_s": round(plain, 1),
           "stage_tokens_per_s": stage, "stage_wall_s": round(stage_wall, 1),
           "stage_done_seconds": done["seconds"], "ratio": round(stage / plain, 3),
           "store_bytes": done["summary"]["store_bytes"], "bytes_per_token": done["summary"]["bytes_per_token"],
           "ratio_wall": round(tokens / done["seconds"] / plain, 3)}
    (Path(args.runs) / "extract_ratio.json").write_text(json.dumps(res, indent=1) + "\n")
    log(f"extract ratio: {json.dumps(res)}")
    if args.drop_store:   # the run trains online: keep the measurement, free the disk
        shutil.rmtree(run / "extract" / "store", ignore_errors=True)


def cmd_budget(args) -> None:
    cfg = load_cfg(args)
    run = Path(cfg.run_dir)
    tokens = json.loads((run / "tokenize" / "done.json").read_text())["summary"]["tokens"]
    loop = json.loads(Path(args.loop_json).read_text())
    row = next(r for r in loop["rows"] if r["shape"] == "smollm2")
    loop_rate = row["in_loop_tokens_per_s"]
    prefill = json.loads((Path(args.runs) / "extract_ratio.json").read_text())["plain_tokens_per_s"]
    rate = 1 / (1 / loop_rate + 1 / prefill) if cfg.train.mode == "online" else loop_rate
    epochs = round(max(0.5, args.train_minutes * 60 * rate * args.safety / tokens), 2)
    res = {"overrides": [f"train.epochs={epochs}"],
           "reasons": {"tokens": tokens, "loop_tokens_per_s": loop_rate, "prefill_tokens_per_s": prefill,
                       "expected_tokens_per_s": round(rate, 1), "train_minutes": args.train_minutes,
                       "safety": args.safety, "epochs": epochs}}
    (Path(args.runs) / "budget.json").write_text(json.dumps(res, indent=1) + "\n")
    log(f"budget: {json.dumps(res)}")


# -------------------------------------------------------------------------------------------------- evaluate
def _prompts(args, n: int) -> list[tuple[str, str, list]]:
    from eyas.config import SourceConfig
    from eyas.data.formats import load_source
    from eyas.records import SkipCounter

    out = []
    for name, (rel, fmt) in EVAL_SETS.items():
        convs = list(load_source(SourceConfig(path=str(Path(args.data) / rel), format=fmt), SkipCounter(), {}))
        for conv in convs[:n]:
            msgs = conv.chat_messages()
            first_user = next(i for i, m in enumerate(msgs) if m["role"] == "user")
            out.append((name, conv.id, msgs[: first_user + 1]))
    return out


def eval_worker(args) -> None:
    """This worker's share of (set, prompt, method) tasks; one JSON line per task on stdout."""
    from eyas.data.chat import render_prompt
    from eyas.evaluate.decoder import (SpecConfig, check_greedy, lookup_generate, speculative_generate,
                                       target_generate)
    from eyas.drafter import load_drafter
    from eyas.targets.load import load_target, load_target_head

    cfg = load_cfg(args)
    target = load_target(cfg.target)
    tok = target.tokenizer
    eos = set(x for x in [tok.eos_token_id] if x is not None)
    ge = target.model.generation_config.eos_token_id
    eos |= set(ge if isinstance(ge, list) else [ge] if ge is not None else [])
    embed, _ = load_target_head(cfg.target)
    draft, dcfg = load_drafter(Path(cfg.run_dir) / "export" / "sglang", embed, num_target_layers=target.num_layers)
    layer_ids = dcfg.layer_ids("output_of_layer")
    draft.to(target.device)
    specs = {"chain3": SpecConfig(depth=3), "chain7": SpecConfig(depth=7),
             "tree_d5_k4_n8": SpecConfig(depth=5, topk=4, total_tokens=8)}
    prompts = _prompts(args, args.prompts_per_set)
    jobs = [(m, p) for p in range(len(prompts)) for m in list(specs) + ["ngram3"]]
    for j, (method, p) in enumerate(jobs):
        if j % args.workers != args.worker:
            continue
        name, pid, msgs = prompts[p]
        ids = tok(render_prompt(tok, msgs), add_special_tokens=False).input_ids
        t0 = time.perf_counter()
        if method == "ngram3":
            st = lookup_generate(target.model, ids, 3, args.max_new_tokens, eos)
        else:
            st = speculative_generate(target.model, draft, ids, layer_ids, specs[method], args.max_new_tokens, eos)
        row = {"method": method, "set": name, "id": pid, "new_tokens": len(st.tokens), "rounds": st.rounds,
               "accepted": st.accepted, "accepted_per_pos": st.accepted_per_pos,
               "seconds": round(time.perf_counter() - t0, 3)}
        if method == "chain3":   # the lossless check (eyas.evaluate.decoder.check_greedy: exact, or a near-tie)
            plain = target_generate(target.model, ids, args.max_new_tokens, eos, reference=st.tokens)
            row["lossless"] = check_greedy(target.model, ids, plain, st.tokens).to_json()
        print(json.dumps(row), flush=True)


def cmd_evaluate(args) -> None:
    procs = []
    for w in range(args.workers):
        cmd = [sys.executable, __file__, "eval-worker", "--runs", args.runs, "--data", args.data, "--worker", str(w),
               "--workers", str(args.workers), "--max-new-tokens", str(args.max_new_tokens),
               "--prompts-per-set", str(args.prompts_per_set), "--config", str(args.config)]
        cmd += sum([["--set", s] for s in args.set or []], [])
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    rows = []
    for p in procs:
        out, _ = p.communicate()
        rows += [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    table: dict = {}
    for r in rows:
        t = table.setdefault((r["method"], r["set"]), {"prompts": 0, "rounds": 0, "accepted": 0, "new_tokens": 0,
                                                       "seconds": 0.0, "accepted_per_pos": None, "lossless_fail": 0,
                                                       "lossless_near_ties": 0})
        t["prompts"] += 1
        for k in ("rounds", "accepted", "new_tokens", "seconds"):
            t[k] += r[k]
        t["accepted_per_pos"] = [a + b for a, b in zip(t["accepted_per_pos"] or [0] * len(r["accepted_per_pos"]),
                                                       r["accepted_per_pos"])]
        status = (r.get("lossless") or {}).get("status")
        t["lossless_fail"] += status == "failed"
        t["lossless_near_ties"] += status == "parted_at_near_tie"
    result = []
    for (m, s), t in sorted(table.items()):
        t.update(method=m, set=s, tokens_per_target_step=round((t["rounds"] + t["accepted"]) / max(t["rounds"], 1), 4),
                 acceptance_rate_per_position=[round(a / max(t["rounds"], 1), 4) for a in t["accepted_per_pos"]])
        result.append(t)
        log(f"{m:14s} {s:10s} prompts {t['prompts']:3d}  tokens per target step {t['tokens_per_target_step']:.3f}"
            f"  per position {t['acceptance_rate_per_position']}  lossless failures {t['lossless_fail']}"
            f" (near-ties {t['lossless_near_ties']})")
    (Path(args.runs) / "eval_sets.json").write_text(json.dumps(
        {"max_new_tokens": args.max_new_tokens, "prompts_per_set": args.prompts_per_set, "results": result,
         "per_prompt": rows}) + "\n")


def cmd_pack(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = Path(args.runs)
    files = [p for p in (runs / "budget.json", runs / "extract_ratio.json", runs / "eval_sets.json") if p.exists()]
    rc = subprocess.run(["tar", "czf", str(out / "results.tar.gz"), "--exclude=store", "--exclude=checkpoints",
                         "--exclude=*.safetensors", "--exclude=tensorboard", "-C", str(runs), "headline",
                         *[p.name for p in files]]).returncode
    if rc > 1:
        raise SystemExit(f"tar failed ({rc})")
    drafter = runs / "headline" / "export" / "sglang"
    for f in sorted(drafter.glob("*.safetensors")):
        shutil.copy(f, out / f"drafter_{f.name}")
    for f in sorted(out.iterdir()):
        log(f"{f.name}: {f.stat().st_size:,} bytes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["stages", "extract-ratio", "budget", "evaluate", "eval-worker", "pack"])
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--runs", default=os.environ.get("HEADLINE_RUNS", str(REPO / "runs")))
    ap.add_argument("--set", action="append", help="extra key=value config override")
    ap.add_argument("--stages", default="prepare,generate,tokenize,vocab")
    ap.add_argument("--time-limit", type=float, default=None, help="seconds this command may use")
    ap.add_argument("--drop-store", action="store_true")
    ap.add_argument("--loop-json", default="/root/train_loop.json")
    ap.add_argument("--train-minutes", type=float, default=9.0)
    ap.add_argument("--safety", type=float, default=0.85)
    ap.add_argument("--data", default=os.environ.get("HEADLINE_DATA", str(REPO / ".hdata")))
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--worker", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--prompts-per-set", type=int, default=80)
    ap.add_argument("--out", default=os.environ.get("OUT", str(REPO / "runs" / "out")))
    args = ap.parse_args()
    {"stages": cmd_stages, "extract-ratio": cmd_extract_ratio, "budget": cmd_budget, "evaluate": cmd_evaluate,
     "eval-worker": eval_worker, "pack": cmd_pack}[args.command](args)


if __name__ == "__main__":
    main()
