"""The headline run (issue 8): SmolLM2-135M-Instruct drafted on ../shared/data/train on one H200, resumable.

Every stage is Eyas's own (``python -m eyas.cli STAGE CONFIG``); this file only measures around them, picks the two
budget settings it must measure first, sets up the side-by-side variants, evaluates the drafters on the three
evaluation sets in parallel processes, and packs what comes back. bench/headline.sh chains the device calls.

Sub-commands (each resumable: a finished stage is skipped by Eyas's fingerprints):
    probe       target throughput (plain prefill, capture prefill) and generate decode-step time, a synthetic
                training-step time of three concurrent trainings; writes RUNS/budget.json with the chosen
                ``generate.max_new_tokens`` and ``train.epochs`` and the reason for each
    stages      run the named stages of one run (headline or a variant) with RUNS/budget.json's overrides
    variants    make the variant run folders: ``ttt3`` (train.ttt_steps=3) shares prepare..extract with the
                headline (hard links), ``fp8`` (extract.aux_format=float8_e4m3fn) shares prepare..vocab
    train-all   train the headline and both variants concurrently on the one GPU, then export each
    evaluate    acceptance length per evaluation set (MT-bench, HumanEval, GSM8K test), greedy, chain 3 and 7 and
                a tree, with Eyas's reference decoder (eyas.evaluate.decoder), prompts spread over worker processes
    pack        copy results (run folders without hidden states and checkpoints) and the headline drafter (split
                into parts under 15 MiB) to OUT

Figures: tokens/s per stage from Eyas's own summaries and ``done.json`` wall times; extraction as a fraction of the
target's plain prefill throughput measured here on the same batch shape; training MFU = 6 x trainable parameters
touched per token plus attention (bench/train_step.py's convention) over 790 TFLOP/s (the bf16 matmul rate
measured on these H200s, /work/.library/device/KINDS.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "bench" / "headline.yaml"
PEAK_TFLOPS = 790.0  # bf16 matmul on random data, measured on this workplace's H200s (KINDS.md, 2026-10-28)
VARIANTS = {
    "headline": [],
    "ttt3": ["train.ttt_steps=3"],
    "fp8": ["extract.aux_format=float8_e4m3fn"],
}
SHARED_STAGES = {"ttt3": ["prepare", "generate", "tokenize", "vocab", "extract"],
                 "fp8": ["prepare", "generate", "tokenize", "vocab"]}
EVAL_SETS = {  # name -> (file under the data root, format, prompts used)
    "mt_bench": ("eval/mt_bench.jsonl", "mt_bench", 80),
    "humaneval": ("eval/humaneval.jsonl", "prompts", 80),
    "gsm8k": ("eval/gsm8k_test.jsonl", "gsm8k", 80),
}


def log(msg: str) -> None:
    print(f"[headline {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------- config and runs
def base_overrides(args) -> list[str]:
    """Overrides every call applies: the budget choices made by ``probe``, then the CLI's ``--set`` items (which
    win: a later override of the same key replaces an earlier one)."""
    out = []
    budget = Path(args.runs) / "budget.json"
    if budget.exists():
        out += json.loads(budget.read_text())["overrides"]
    return out + list(args.set or [])


def run_overrides(args, variant: str) -> list[str]:
    return [f"run_dir={Path(args.runs) / variant}"] + base_overrides(args) + VARIANTS[variant]


def load_cfg(args, variant: str = "headline"):
    from eyas.config import load_config

    return load_config(args.config, run_overrides(args, variant))


def eyas(stage: str, args, variant: str, timeout: float | None = None) -> int:
    """Run one Eyas stage as its own process (``python -m eyas.cli``); returns its exit status."""
    cmd = [sys.executable, "-m", "eyas.cli", stage, str(args.config), *run_overrides(args, variant)]
    log(f"{variant}: eyas {stage}")
    try:
        return subprocess.run(cmd, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        log(f"{variant}: {stage} stopped at the time limit; it resumes on the next call")
        return 124


# ----------------------------------------------------------------------------------------------------- probe
def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _sync_time(fn, repeat: int) -> float:
    """Seconds per call of ``fn`` (one warm-up call first; the device synchronised around the timed calls)."""
    fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    _sync()
    return (time.perf_counter() - t0) / repeat


def probe_target(args) -> dict:
    """Plain prefill and capture prefill throughput (tokens/s, same batch), and generate's decode-step time."""
    import torch

    from eyas.capture.transformers_backend import _decoder_layers  # noqa: F401  (same layers the capture hooks)
    from eyas.families import default_aux_layer_ids
    from eyas.targets.load import load_target

    cfg = load_cfg(args)
    target = load_target(cfg.target)
    model, tok, dev = target.model, target.tokenizer, target.device
    g = torch.Generator().manual_seed(0)
    B, T = args.probe_batch
    ids = torch.randint(100, len(tok), (B, T), generator=g).to(dev)
    mask = torch.ones_like(ids)
    res: dict = {"batch": [B, T], "torch": torch.__version__,
                 "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}
    with torch.no_grad():
        plain = _sync_time(lambda: model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1), 5)
        res["plain_prefill_tokens_per_s"] = round(B * T / plain)
        layers = default_aux_layer_ids(target.num_layers)
        kept: list = []
        hooks = [model.model.layers[i].register_forward_hook(lambda m, i, o: kept.append(o[0] if isinstance(
            o, tuple) else o)) for i in layers]

        def capture():
            kept.clear()
            out = model.model(input_ids=ids, attention_mask=mask, use_cache=False)
            torch.stack(kept, 2).cpu(), out.last_hidden_state.cpu()
        cap = _sync_time(capture, 3)
        for h in hooks:
            h.remove()
        res["capture_prefill_with_copy_to_host_tokens_per_s"] = round(B * T / cap)
        # generate's decode step at the configured batch: the stage's own generate_batch, forced to full length
        from eyas.data.chat import render_prompt
        from eyas.data.formats import load_source
        from eyas.records import SkipCounter

        src = cfg.prepare.sources[-1]  # gsm8k_train: short single-turn prompts
        prompts = []
        for conv in load_source(src, SkipCounter(), {}):
            prompts.append(render_prompt(tok, [conv.chat_messages()[0]]))
            if len(prompts) == min(cfg.generate.batch_size, args.probe_generate_batch):
                break
        tok.padding_side = "left"
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(dev)
        times = {}
        for n in (8, 8 + args.probe_generate_steps):
            kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, temperature=None, top_p=None,
                      top_k=None, pad_token_id=tok.pad_token_id)
            times[n] = _sync_time(lambda: model.generate(**enc, **kw), 1)
        step = (times[8 + args.probe_generate_steps] - times[8]) / args.probe_generate_steps
        res["generate_batch"] = len(prompts)
        res["generate_prompt_tokens"] = int(enc.input_ids.shape[1])
        res["generate_decode_step_s"] = round(step, 5)
        res["generate_decode_tokens_per_s"] = round(len(prompts) / step)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def generate_calls(args) -> int:
    """How many ``generate_batch`` calls the stage makes: per batch of conversations (longest first, as the stage
    orders them), as many calls as the most user turns in it."""
    from eyas.data.formats import load_source
    from eyas.records import SkipCounter

    cfg = load_cfg(args)
    convs, seen = [], set()
    for src in cfg.prepare.sources:
        for c in load_source(src, SkipCounter(), {}):
            if c.id not in seen:
                seen.add(c.id)
                convs.append(c)
    convs.sort(key=lambda c: -sum(len(m.content) for m in c.messages))
    B = cfg.generate.batch_size
    return sum(max(sum(m.role == "user" for m in c.messages) for c in convs[b: b + B])
               for b in range(0, len(convs), B)), len(convs)


def probe_train_worker(args) -> None:
    """One synthetic training run of the headline draft shape: Eyas's own loop on random states with the real
    sample lengths; prints the median optimizer-step time (warm-up steps dropped)."""
    import torch

    from eyas.config import TrainConfig
    from eyas.targets.load import read_target_config, resolve_device
    from eyas.train.build import build_draft, draft_config_for
    from eyas.train.data import epoch_plan
    from eyas.train.loop import train

    cfg = load_cfg(args)
    tcfg = read_target_config(cfg.target)
    Ht, V = int(tcfg["hidden_size"]), int(tcfg["vocab_size"])
    dcfg = draft_config_for(tcfg, cfg.train.draft, cfg.vocab.draft_vocab_size, 3)
    g = torch.Generator().manual_seed(args.seed)
    draft_ids = torch.randperm(V, generator=g)[: cfg.vocab.draft_vocab_size].sort().values
    d2t = draft_ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    embed = torch.randn(V, Ht, generator=g) * 0.02
    model = build_draft(dcfg, embed, d2t, t2d, 0)
    lengths = json.loads(args.lengths)
    # one pool of random states, sliced per sample (drawing fresh normals per sample would time the CPU's RNG)
    dt = torch.bfloat16 if cfg.train.autocast == "bfloat16" else torch.float32  # as the store's states arrive
    aux_pool = torch.randn(max(lengths), 3 * Ht, generator=g).to(dt)
    last_pool = torch.randn(max(lengths), Ht, generator=g).to(dt)

    class Synthetic:
        def __len__(self):
            return len(lengths)

        def num_tokens(self, i):
            return lengths[i]

        def __getitem__(self, i):
            n = lengths[i]
            ids = torch.randint(0, V, (n,), generator=g)
            return {"id": f"synthetic-{i}", "input_ids": ids, "loss_mask": torch.ones(n, dtype=torch.int64),
                    "aux": aux_pool[:n], "last": last_pool[:n]}

    per_epoch = len(epoch_plan(lengths, cfg.train.batch_size, 1, cfg.train.seed, 0, cfg.train.batch_tokens))
    steps = args.probe_train_steps
    tc = TrainConfig(**{**cfg.train.model_dump(), "epochs": steps / per_epoch, "checkpoint_every": 10_000,
                        "log_every": 10_000, "tensorboard": False})
    out = Path(args.scratch)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    lm_head = torch.randn(V, Ht, generator=g) * 0.02
    stamps = [time.perf_counter()]

    def stamp(step: int) -> bool:
        _sync()
        stamps.append(time.perf_counter())
        return False

    train(model, Synthetic(), lm_head, tc, out, resolve_device(cfg.train.device), {}, log=lambda m: None,
          should_stop=stamp)
    per_step = [b - a for a, b in zip(stamps, stamps[1:])][2:]  # drop warm-up steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    print(json.dumps({"step_s": sorted(per_step)[len(per_step) // 2], "steps": len(per_step), "peak_gb": peak}),
          flush=True)


def cmd_probe(args) -> None:
    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    budget_file = runs / "budget.json"
    if budget_file.exists():
        log(f"{budget_file} exists: budget already chosen")
        return
    res = probe_target(args)
    calls, n_convs = generate_calls(args)
    cfg = load_cfg(args)
    res["generate_calls"] = calls
    res["conversations"] = n_convs
    # Decode steps slow down as the cache grows; 1.5x the short-context step covers the mean context (~600 tokens).
    est = {n: round(calls * n * res["generate_decode_step_s"] * 1.5) for n in (512, 256)}
    res["generate_estimated_s"] = est
    overrides, reasons = [], {}
    if est[512] > args.generate_budget_s and cfg.generate.max_new_tokens > 256:
        overrides.append("generate.max_new_tokens=256")
        reasons["generate.max_new_tokens"] = (
            f"measured decode step {res['generate_decode_step_s'] * 1e3:.1f} ms at batch {res['generate_batch']}: "
            f"{calls} generate calls x 512 tokens would take ~{est[512]} s, over the {args.generate_budget_s} s this "
            f"stage may use of the session's device time; 256 tokens ~{est[256]} s")
    budget = {"overrides": overrides, "reasons": reasons, "probe": res}
    budget_file.write_text(json.dumps(budget, indent=2) + "\n")
    log(json.dumps(budget, indent=2))


def cmd_probe_train(args) -> None:
    """Time three concurrent trainings (headline, ttt3, fp8 shapes are equal; K = 7 is the slowest) on synthetic
    states with the tokenized samples' real lengths, and add the ``train.epochs`` that fits the budget."""
    import random

    runs = Path(args.runs)
    budget_file = runs / "budget.json"
    budget = json.loads(budget_file.read_text())
    if any(o.startswith("train.epochs=") for o in budget["overrides"]) or "train_probe" in budget:
        log("train budget already chosen")
        return
    cfg = load_cfg(args)
    from eyas.records import read_tokenized
    from eyas.run_folder import RunFolder
    from eyas.train.data import epoch_plan

    lengths = [min(s.num_tokens, cfg.train.max_length) for s in read_tokenized(RunFolder(runs / "headline").tokenized)]
    n_samples = len(lengths)
    steps_per_epoch = len(epoch_plan(lengths, cfg.train.batch_size, 1, cfg.train.seed, 0, cfg.train.batch_tokens))
    random.Random(0).shuffle(lengths)
    lengths = lengths[:600]  # a sample of the real length mix
    procs = []
    for i in range(3):
        cmd = [sys.executable, __file__, "probe-train-worker", "--runs", args.runs, "--seed", str(i),
               "--scratch", str(runs / f"probe_train_{i}"), "--lengths", json.dumps(lengths),
               "--probe-train-steps", str(args.probe_train_steps)] + sum([["--set", s] for s in args.set or []], [])
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    step_s = max(o["step_s"] for o in outs)
    epochs = min(cfg.train.epochs, args.train_budget_s / (steps_per_epoch * step_s))
    epochs = math.floor(epochs * 20) / 20
    budget["train_probe"] = {"concurrent_step_s": [round(o["step_s"], 4) for o in outs],
                             "peak_gb": [round(o["peak_gb"], 1) for o in outs], "samples": n_samples,
                             "steps_per_epoch": steps_per_epoch, "epochs": epochs}
    if epochs < cfg.train.epochs:
        budget["overrides"].append(f"train.epochs={epochs}")
        budget["reasons"]["train.epochs"] = (
            f"three concurrent trainings take {step_s:.3f} s per step (synthetic states, real loop, real lengths); "
            f"{steps_per_epoch} steps per epoch; {epochs} epochs fit the {args.train_budget_s:.0f} s budget")
    budget_file.write_text(json.dumps(budget, indent=2) + "\n")
    log(json.dumps(budget["train_probe"]))
    for i in range(3):
        shutil.rmtree(runs / f"probe_train_{i}", ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- stages
def cmd_stages(args) -> None:
    deadline = time.time() + args.time_limit if args.time_limit else None
    for stage in args.stages.split(","):
        left = None if deadline is None else max(1.0, deadline - time.time())
        rc = eyas(stage, args, args.variant, timeout=left)
        if rc != 0:
            log(f"{args.variant}: {stage} exited {rc}; stopping here")
            sys.exit(rc)


def cmd_variants(args) -> None:
    """Variant folders share the headline's finished upstream stages through hard links (same run id, so the
    store's run-id checks hold); Eyas's fingerprints then skip them and redo only what differs."""
    from eyas.run_folder import RunFolder

    runs = Path(args.runs)
    head = RunFolder(runs / "headline")
    for name, stages in SHARED_STAGES.items():
        dst = RunFolder(runs / name)
        dst.root.mkdir(parents=True, exist_ok=True)
        shutil.copy2(head.run_json, dst.run_json)
        for s in stages:
            if not head.done(s).exists():
                raise SystemExit(f"{head.stage(s)} has not finished: run the headline's stages first")
            if not dst.stage(s).exists():
                subprocess.run(["cp", "-al", str(head.stage(s)), str(dst.stage(s))], check=True)
        log(f"{dst.root}: shares {', '.join(stages)} with the headline")


def cmd_train_all(args) -> None:
    """Train the three runs at once (the draft is small: one training leaves most of the H200 idle)."""
    procs = {}
    deadline = time.time() + args.time_limit
    for v in args.variants.split(","):
        cmd = [sys.executable, "-m", "eyas.cli", "train", str(args.config), *run_overrides(args, v)]
        logf = open(Path(args.runs) / f"train_{v}.log", "a")
        procs[v] = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
        log(f"{v}: training (log {logf.name})")
    for v, p in procs.items():
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.terminate()
            p.wait()
            log(f"{v}: training stopped at the time limit; it resumes from its last checkpoint")
    for v, p in procs.items():
        log(f"{v}: train exited {p.returncode}")
        if p.returncode == 0:
            eyas("export", args, v)


# -------------------------------------------------------------------------------------------------- evaluate
def _eval_prompts(args) -> list[tuple[str, str, list]]:
    from eyas.config import SourceConfig
    from eyas.data.formats import load_source
    from eyas.records import SkipCounter

    out = []
    for name, (rel, fmt, n) in EVAL_SETS.items():
        convs = list(load_source(SourceConfig(path=str(Path(args.data) / rel), format=fmt), SkipCounter(), {}))
        for conv in convs[: min(n, args.prompts_per_set)]:
            msgs = conv.chat_messages()
            first_user = next(i for i, m in enumerate(msgs) if m["role"] == "user")
            out.append((name, conv.id, msgs[: first_user + 1]))
    return out


def _specs() -> dict:
    from eyas.evaluate import decoder

    specs = {"chain3": 3, "chain7": 7}
    if hasattr(decoder, "SpecConfig"):  # the tree decoder (EAGLE-2 dynamic tree) of eyas.evaluate.decoder
        specs["tree_d5_k4_n8"] = decoder.SpecConfig(depth=5, topk=4, total_tokens=8)
    return specs


def eval_worker(args) -> None:
    """Decode this worker's share of (run, set, prompt, spec) tasks; one JSON line per task on stdout."""
    from eyas.data.chat import render_prompt
    from eyas.evaluate.decoder import speculative_generate
    from eyas.drafter import load_drafter
    from eyas.run_folder import RunFolder
    from eyas.targets.load import load_target, load_target_head

    cfg = load_cfg(args)
    target = load_target(cfg.target)
    tok = target.tokenizer
    eos = set(x for x in [tok.eos_token_id] if x is not None)
    ge = target.model.generation_config.eos_token_id
    eos |= set(ge if isinstance(ge, list) else [ge] if ge is not None else [])
    embed, _ = load_target_head(cfg.target)
    specs = _specs()
    prompts = _eval_prompts(args)
    drafts = {}
    for v in args.variants.split(","):
        folder = RunFolder(Path(args.runs) / v).export("sglang")
        if (folder / "config.json").exists():
            d, dcfg = load_drafter(folder, embed, engine="sglang")
            drafts[v] = (d.to(target.device), dcfg.layer_ids("output_of_layer"))  # fp32 draft, bf16 target
    tasks = [(v, sname) for v in drafts for sname in specs if v == "headline" or sname != "tree_d5_k4_n8"]
    jobs = [(v, s, p) for v, s in tasks for p in range(len(prompts))]
    for j, (v, sname, p) in enumerate(jobs):
        if j % args.workers != args.worker:
            continue
        name, pid, msgs = prompts[p]
        ids = tok(render_prompt(tok, msgs), add_special_tokens=False).input_ids
        draft, layer_ids = drafts[v]
        t0 = time.perf_counter()
        st = speculative_generate(target.model, draft, ids, layer_ids, specs[sname], args.max_new_tokens, eos)
        print(json.dumps({"run": v, "spec": sname, "set": name, "id": pid, "new_tokens": len(st.tokens),
                          "rounds": st.rounds, "accepted": st.accepted, "accepted_per_pos": st.accepted_per_pos,
                          "seconds": round(time.perf_counter() - t0, 3)}), flush=True)


def cmd_evaluate(args) -> None:
    procs = []
    for w in range(args.workers):
        cmd = [sys.executable, __file__, "eval-worker", "--runs", args.runs, "--data", args.data, "--worker", str(w),
               "--workers", str(args.workers), "--variants", args.variants,
               "--max-new-tokens", str(args.max_new_tokens), "--prompts-per-set", str(args.prompts_per_set)]
        cmd += sum([["--set", s] for s in args.set or []], [])
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    rows = []
    for p in procs:
        out, _ = p.communicate()
        rows += [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    table: dict = {}
    for r in rows:
        key = (r["run"], r["spec"], r["set"])
        t = table.setdefault(key, {"prompts": 0, "rounds": 0, "accepted": 0, "new_tokens": 0, "seconds": 0.0})
        t["prompts"] += 1
        for k in ("rounds", "accepted", "new_tokens", "seconds"):
            t[k] += r[k]
    result = []
    for (v, s, n), t in sorted(table.items()):
        t.update(run=v, spec=s, set=n, acceptance_length=round((t["rounds"] + t["accepted"]) / max(t["rounds"], 1), 4))
        result.append(t)
        log(f"{v:9s} {s:14s} {n:10s} prompts {t['prompts']:4d}  acceptance length {t['acceptance_length']:.3f}")
    out = Path(args.runs) / "eval_sets.json"
    out.write_text(json.dumps({"max_new_tokens": args.max_new_tokens, "results": result, "per_prompt": rows}) + "\n")


# ------------------------------------------------------------------------------------------------------ pack
def cmd_pack(args) -> None:
    """OUT/results.tar.gz: every run folder without hidden states, checkpoints or weights; OUT/drafter_*.tar.part_*:
    the headline's SGLang folder in parts under 15 MiB (the device returns files of at most 16 MiB)."""
    from eyas.run_folder import RunFolder

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = Path(args.runs)
    skip = [f"--exclude={runs.name}/{out.resolve().relative_to(runs.resolve())}"] \
        if out.resolve().is_relative_to(runs.resolve()) else []
    rc = subprocess.run(["tar", "czf", str(out / "results.tar.gz"), "--exclude=store", "--exclude=checkpoints",
                         "--exclude=probe_train_*", "--exclude=final", "--exclude=export", *skip,
                         "-C", str(runs.parent), runs.name]).returncode  # drafters travel as parts, below
    if rc > 1:  # 1: a file changed while it was read (a log still being written): the archive is still whole
        raise SystemExit(f"tar failed ({rc})")
    for v in args.drafters.split(","):
        folder = RunFolder(runs / v).export("sglang")
        if (folder / "config.json").exists():
            tarf = out / f"drafter_{v}.tar"
            subprocess.run(["tar", "cf", str(tarf), "-C", str(folder.parent), folder.name], check=True)
            subprocess.run(["split", "-b", "15M", "-d", str(tarf), str(tarf) + ".part_"], check=True)
            tarf.unlink()
    for f in sorted(out.iterdir()):
        log(f"{f.name}: {f.stat().st_size} bytes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["probe", "probe-train", "probe-train-worker", "stages", "variants", "train-all",
                                        "evaluate", "eval-worker", "pack"])
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--runs", default=os.environ.get("HEADLINE_RUNS", str(REPO / "runs")),
                    help="folder of the run folders (headline, ttt3, fp8); default $HEADLINE_RUNS or runs/")
    ap.add_argument("--set", action="append", help="extra key=value config override (every run)")
    ap.add_argument("--variant", default="headline", choices=list(VARIANTS))
    ap.add_argument("--variants", default="headline,ttt3,fp8")
    ap.add_argument("--stages", default="prepare,generate")
    ap.add_argument("--time-limit", type=float, default=None, help="seconds this command may use")
    ap.add_argument("--generate-budget-s", type=float, default=200)
    ap.add_argument("--train-budget-s", type=float, default=180)
    ap.add_argument("--data", default=str(REPO / ".hdata"))
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--worker", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--prompts-per-set", type=int, default=80)
    ap.add_argument("--out", default=os.environ.get("OUT", str(REPO / "runs" / "out")))
    ap.add_argument("--drafters", default="headline")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--probe-batch", type=int, nargs=2, default=[64, 1024], help="prefill batch, tokens")
    ap.add_argument("--probe-generate-batch", type=int, default=512)
    ap.add_argument("--probe-generate-steps", type=int, default=64)
    ap.add_argument("--probe-train-steps", type=int, default=10)
    ap.add_argument("--scratch", default="")
    ap.add_argument("--lengths", default="[]")
    args = ap.parse_args()
    {"probe": cmd_probe, "probe-train": cmd_probe_train, "probe-train-worker": probe_train_worker, "stages": cmd_stages, "variants": cmd_variants,
     "train-all": cmd_train_all, "evaluate": cmd_evaluate, "eval-worker": eval_worker, "pack": cmd_pack}[
        args.command](args)


if __name__ == "__main__":
    main()
