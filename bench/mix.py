"""The data experiment of issue 18 on one H200: which training mix makes the SmolLM2-135M-Instruct drafter pay off
on chat, code and math, at equal training tokens, and the best mix trained to the end of its held-out curve.

Arms (``ARMS``; every arm decontaminated against the three evaluation sets and near-duplicates removed):
    a     the five files of the first headline run (58% GSM8K, no code)
    b     all fourteen files of ../shared/data/train, GSM8K capped at 2,500 conversations
    c10   b plus 10,000 prompts SmolLM2 wrote itself (Magpie, ``prepare.self_prompts``)
    c30   b plus 30,000 of them
    d     all fourteen files with GSM8K uncapped, every prompt of ``--self-prompts-file``, and the new ones kept
          whole: ``--more-self-prompts-file``'s and/or ``--more-self-prompts`` sampled in this run (with
          ``--self-prompt-seed``; near-duplicates across all of them removed by prepare)

Phases of ``all`` (one process on the device, started with setsid so that it outlives each device call; ``wait``
calls watch it; every stage is Eyas's own, ``python -m eyas.cli STAGE CONFIG``):
    1. selfp      the self-prompts, once (a prepare with only ``self_prompts``), written out as a prompts file
    2. prepare    the four arms' prepare in parallel (CPU), while the probe set's replies are generated (GPU)
    3. generate   the largest arm asked for (c30) in full; the others take their replies from it
                  (``generate.reuse_from``) and generate only what it lacks (a's uncapped GSM8K)
    4. tokenize, vocab of every arm in parallel
    5. train      the four arms at once, online, each planned for the same training tokens (``--tokens``); at
                  ``--probe-step`` every arm's checkpoint is probed, the best arm (the mean over the three sets of
                  its teacher-forced accuracy at TTT positions 0-2) trains on alone to the end of its schedule or
                  held-out curve, the others are stopped
    6. export of the best arm; the probe of its final drafter
An arm whose config says ``train.mode: offline`` (``--set``, or a variant's settings) has its store extracted
after vocab (4b). ``--all-to-end`` trains every arm to its end and exports and probes each (an A/B of settings:
issue 20's stores (a)-(d) as variants of one arm).
The probe: teacher-forced accuracy per TTT position of a drafter on the target's own greedy replies (256 new
tokens) to the first 80 prompts of MT-bench (both turns), HumanEval and the GSM8K test set, computed as training's
held-out evaluation (``eyas.train.loop.evaluate_held_out``) with the target run online.

    python bench/mix.py all [--arms a,b,c10,c30] [--tokens 52e6] [--probe-step 600] [--deadline-s 1260] [--set k=v]
                            [--variant NAME=ARM:k=v;k=v]  # another arm on ARM's data with its own settings
    python bench/mix.py wait --max-seconds 560     # progress, returns when ``all`` ends or the time is up
    python bench/mix.py pack --out DIR             # results.json, logs, the best drafter's weight files
``--stop-after data`` ends ``all`` before training (a device call of its own); the same command again, without
it, finds every stage done (Eyas skips a finished stage) and trains: a run in two calls, each ending whole.
Writes RUNS/mix.log (progress), RUNS/results.json (per arm: the prepare mix, tokens, generate figures, training
curve, probes; the choice), RUNS/<arm>/ (run folders).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "bench" / "mix.yaml"
FIVE = ["sharegpt_sg90k_sampled.json", "sharegpt_prompts_500.json", "sharegpt_multiturn.jsonl",
        "alpaca_en_demo.json", "gsm8k_train.jsonl"]
NINE = ["gpteacher_codegen.json", "evol_code_r1.json", "evol_code_r2.json", "leetcode_train.jsonl.gz",
        "mbpp_train.jsonl", "awesome_chatgpt_prompts.csv", "gpteacher_roleplay.json", "mtbench101.jsonl",
        "oasst_prompts_350.jsonl"]
FIELDS = {"leetcode_train.jsonl.gz": {"prompt": "query"}}   # its `prompt` column is an import header
GSM8K_CAP = 2500
PROBE_SETS = {"mt_bench": ("eval/mt_bench.jsonl", "mt_bench"), "humaneval": ("eval/humaneval.jsonl", "prompts"),
              "gsm8k": ("eval/gsm8k_test.jsonl", "gsm8k")}
T0 = time.time()
ORDER = ["a", "b", "c10", "c30", "d"]   # by size: the largest arm asked for is generated in full
VARIANTS: dict[str, tuple[str, list[str]]] = {}   # --variant: name -> (the arm whose data it trains on, its --sets)


def log(runs: Path, msg: str) -> None:
    line = f"[mix {time.strftime('%H:%M:%S')} +{time.time() - T0:.0f}s] {msg}"
    print(line, flush=True)
    with open(runs / "mix.log", "a") as f:
        f.write(line + "\n")


def source(name: str, **extra) -> dict:
    s = {"path": f".hdata/train/{name}", **extra}
    if name in FIELDS:
        s["fields"] = FIELDS[name]
    return s


def arms(self_file: str, max_rows: int | None, more_files: Sequence[str] = (),
         weight: float | None = None) -> dict[str, list[dict]]:
    """prepare.sources of each arm; ``max_rows`` shrinks every file (the CPU check); ``more_files``: arm d's newly
    sampled self-prompts (an earlier run's file, this run's sampling, or both); ``weight``: every source but those
    keeps that seeded share of its conversations (the same mix, smaller, beside all of the new prompts: a run that
    must fit one device call)."""
    rows = {"max_rows": max_rows} if max_rows else {}
    lim = rows | ({"weight": weight} if weight else {})
    five = [source(n, **lim) for n in FIVE]
    capped = [source(n, **lim, **({"max_conversations": GSM8K_CAP} if n == "gsm8k_train.jsonl" else {}))
              for n in FIVE + NINE]
    return {"a": five, "b": capped,
            "c10": capped + [{"path": self_file, "format": "prompts", "max_conversations": 10000}],
            "c30": capped + [{"path": self_file, "format": "prompts", "max_conversations": 30000}],
            "d": [source(n, **lim) for n in FIVE + NINE] + [{"path": self_file, "format": "prompts", **lim}]
            + [{"path": f, "format": "prompts", **rows} for f in more_files]}


def ask_to_stop(runs: Path, arm: str) -> None:
    """The deadline: ``arm``'s train stage is asked to stop (``train/STOP``, honoured even while the stage still
    loads); it checkpoints and writes its drafter."""
    log(runs, f"deadline: asking {arm} to stop (train/STOP): it checkpoints and writes its drafter")
    (runs / arm / "train").mkdir(parents=True, exist_ok=True)
    (runs / arm / "train" / "STOP").touch()


def data_arm(name: str) -> str:
    """The arm whose data ``name`` trains on (itself, or a ``--variant``'s base)."""
    return VARIANTS[name][0] if name in VARIANTS else name


def parse_variant(text: str) -> tuple[str, str, list[str]]:
    """``NAME=ARM:k=v;k=v`` -> (NAME, ARM, ["k=v", ...]); raises SystemExit on a malformed one."""
    name, eq, rest = text.partition("=")
    arm, colon, sets = rest.partition(":")
    if not (eq and colon and name.strip() and arm.strip()):
        raise SystemExit(f"--variant {text!r}: write NAME=ARM:key=value[;key=value]")
    return name.strip(), arm.strip(), [x.strip() for x in sets.split(";") if x.strip()]


def write_config(runs: Path, name: str, changes: dict, sets: list[str]) -> Path:
    """RUNS/<name>.yaml: the base config with ``changes`` (dotted keys), the ``--set`` overrides and a variant's own
    settings applied."""
    from eyas.config import _set_dotted  # the loader's own dotted-key setter, so overrides mean the same here

    raw = yaml.safe_load(BASE.read_text())
    raw["run_dir"] = str(runs / name)
    for k, v in changes.items():
        _set_dotted(raw, k, v)
    for item in sets + (VARIANTS[name][1] if name in VARIANTS else []):
        k, _, v = item.partition("=")
        _set_dotted(raw, k.strip(), yaml.safe_load(v))
    path = runs / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def eyas(stage: str, config: Path, *extra: str, wait: bool = True, logfile: Path | None = None):
    cmd = [sys.executable, "-m", "eyas.cli", stage, str(config), *extra]
    out = open(logfile, "a") if logfile else None
    p = subprocess.Popen(cmd, stdout=out or subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=False)
    if not wait:
        return p
    rc = p.wait()
    if rc != 0:
        raise SystemExit(f"eyas {stage} {config} exited {rc} (log: {logfile})")
    return rc


def done(run: Path, stage: str) -> dict:
    d = json.loads((run / stage / "done.json").read_text())
    return {**d["summary"], "seconds": d["seconds"]}


def parallel(runs: Path, jobs: list[tuple[str, Path]]) -> None:
    """``eyas STAGE CONFIG`` for each job at once; raises naming the first that failed."""
    procs = [(s, c, eyas(s, c, wait=False, logfile=runs / f"{c.stem}.log")) for s, c in jobs]
    bad = [(s, c) for s, c, p in procs if p.wait() != 0]
    if bad:
        raise SystemExit(f"failed: {bad} (logs under {runs})")


# ------------------------------------------------------------------------------------------------------ probe
def probe_samples(runs: Path) -> dict[str, list]:
    """set name -> tokenized samples of the probe run (the target's greedy replies to the evaluation prompts)."""
    from eyas.records import read_conversations, read_tokenized

    run = runs / "probe"
    source_of = {c.id: c.source for c in read_conversations(run / "generate" / "conversations.jsonl")}
    by_set: dict[str, list] = {k: [] for k in PROBE_SETS}
    for s in read_tokenized(run / "tokenize" / "samples.jsonl"):
        name = next(k for k, (rel, _) in PROBE_SETS.items() if Path(rel).name in source_of[s.id])
        by_set[name].append(s)
    return by_set


def probe(runs: Path, arm: str, checkpoint: Path | None, drafter: Path | None = None) -> dict:
    """Teacher-forced accuracy per TTT position of ``arm``'s drafter (a checkpoint, or train/final) on each probe set;
    ``drafter``: any drafter folder instead (the one ``train.init_from`` starts from), with ``arm``'s target.

    Returns ``{set: {"acc": [K floats], "loss": float, "samples": n}}``."""
    import torch

    from eyas.config import load_config
    from eyas.data.vocab import draft_to_target_ids, load_vocab
    from eyas.distributed import Dist
    from eyas.drafter import load_drafter
    from eyas.store.header import aux_layer_ids
    from eyas.targets.load import load_target_head, read_target_config
    from eyas.train.build import build_draft, draft_config_for
    from eyas.train.checkpoint import load_checkpoint
    from eyas.train.data import SampleDataset
    from eyas.train.loop import DraftWithLoss, evaluate_held_out
    from eyas.train.online import OnlineStates
    from eyas.families import text_config

    cfg = load_config(runs / f"{arm}.yaml")
    run = runs / arm
    device = torch.device(cfg.train.device if cfg.train.device != "auto" else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    embed, lm_head = load_target_head(cfg.target)
    layer_ids = aux_layer_ids(cfg.target, cfg.extract)   # the store's convention (output_of_layer)
    tcfg = read_target_config(cfg.target)
    if checkpoint is None:
        model, _ = load_drafter(drafter or run / "train" / "final", embed, engine="sglang",
                                num_target_layers=int(text_config(tcfg)["num_hidden_layers"]))
    else:
        d2t, t2d = load_vocab(run / "vocab" / "vocab.safetensors")
        model = build_draft(draft_config_for(tcfg, cfg.train.draft, len(d2t), len(layer_ids)), embed, d2t,
                            t2d, cfg.train.seed)
        state, _, _ = load_checkpoint(checkpoint, torch.device("cpu"))
        missing = set(model.trainable_state_dict()) - set(state)
        assert not missing, missing
        model.load_state_dict(state, strict=False)
    model.to(device)
    model.set_attention("sdpa")
    cuda = device.type == "cuda"
    float_dtype = torch.bfloat16 if cuda else torch.float32
    step_module = DraftWithLoss(model, cfg.train, compiled=False).to(device)
    dist = Dist.from_env(device, cfg.train.distributed)
    draft_ids = draft_to_target_ids(model.d2t.to(device))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    out = {}
    for name, samples in probe_samples(runs).items():
        states = OnlineStates(cfg.target, cfg.extract, layer_ids, samples)
        ev = evaluate_held_out(step_module, SampleDataset(samples, cfg.train.max_length), states,
                               lm_head.to(device, float_dtype), draft_ids, model.t2d, cfg.train, dist, autocast,
                               float_dtype, 64 if cuda else 1)
        states.close()
        K = cfg.train.ttt_steps
        out[name] = {"acc": [round(ev[f"eval_acc_{k}"], 4) for k in range(K)], "loss": round(ev["eval_loss"], 4),
                     "samples": len(samples)}
    return out


def score(p: dict) -> float:
    """The choice: mean over the probe sets of the accuracy at TTT positions 0-2 (what 3 draft tokens use)."""
    return sum(sum(v["acc"][:3]) / 3 for v in p.values()) / len(p)


def checkpoints(run: Path) -> list[Path]:
    from eyas.train.checkpoint import list_checkpoints

    return list_checkpoints(run / "train" / "checkpoints")


def step_of(ckpt: Path) -> int:
    return int(ckpt.name.split("-")[1])


# -------------------------------------------------------------------------------------------------------- all
def cmd_all(args) -> None:
    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    earlier = runs / "results.json"
    results: dict = json.loads(earlier.read_text()) if earlier.exists() else {"arms": {}}   # an earlier call's
    if results.get("stopped_after"):
        results["data_call"] = {"started": results.get("started"), "stopped_after": results.pop("stopped_after")}
    results.update(started=time.strftime("%Y-%m-%dT%H:%M:%S"), tokens_planned=args.tokens,
                   probe_step=args.probe_step)
    for marker in ("ALL_DONE", "FAILED"):      # a `--stop-after` call's end: this call goes on from it
        (runs / marker).unlink(missing_ok=True)
    save = lambda: (runs / "results.json").write_text(json.dumps(results, indent=1) + "\n")  # noqa: E731
    self_file = args.self_prompts_file or str(runs / "self_prompts.jsonl")
    chosen = args.arms.split(",")
    for v in args.variant:
        name, arm, sets = parse_variant(v)
        VARIANTS[name] = (arm, sets)
        chosen.append(name)
    unknown = {data_arm(n) for n in chosen} - set(arms(self_file, None))
    if unknown:
        raise SystemExit(f"--arms/--variant: unknown {sorted(unknown)} (arms: {', '.join(ORDER)})")
    if "d" in {data_arm(n) for n in chosen} and not args.self_prompts_file:
        raise SystemExit("arm d takes --self-prompts-file (and --more-self-prompts N new ones beside it)")
    results["variants"] = {n: {"arm": a, "sets": s} for n, (a, s) in VARIANTS.items()}
    # the arm generated in full (the largest asked for); the others reuse its replies
    full = max([n for n in chosen if n not in VARIANTS] or [data_arm(n) for n in chosen],
               key=ORDER.index)
    if full not in chosen:
        chosen.insert(0, full)
    results["full"] = full

    # 1. the self-prompts, once (only the c arms use them)
    if any(data_arm(a).startswith("c") for a in chosen) and not args.self_prompts_file:
        _self_prompts(runs, args, self_file, results, args.self_prompts, "self_prompts")
        save()
    # arm d's new prompts, kept whole: an earlier run's (--more-self-prompts-file) and/or sampled in this run
    more_files = list(args.more_self_prompts_file)
    if "d" in {data_arm(n) for n in chosen} and args.more_self_prompts:
        more_files.append(str(runs / "self_prompts_more.jsonl"))
        if not Path(more_files[-1]).exists():   # a `--stop-after data` call sampled them already
            _self_prompts(runs, args, more_files[-1], results, args.more_self_prompts, "more_self_prompts")
            save()
    _run_arms(runs, args, self_file, results, save, chosen, full, more_files)


def _self_prompts(runs: Path, args, self_file: str, results: dict, count: int, key: str) -> None:
    steer = {}
    if args.self_prompt_systems:   # prepare.self_prompts.system_prompts: a JSON list of strings (null: default)
        steer["system_prompts"] = json.loads(Path(args.self_prompt_systems).read_text())
    sp = write_config(runs, "selfp", {"prepare.sources": [], "prepare.self_prompts": {
        "count": count, "max_tokens": args.self_prompt_tokens, "min_chars": 16, "languages": ["en"],
        "seed": args.self_prompt_seed, **steer}},
        args.set)
    log(runs, f"selfp: {count} self-prompts asked (seed {args.self_prompt_seed})")
    eyas("prepare", sp, logfile=runs / "selfp.log")
    from eyas.records import read_conversations

    convs = read_conversations(runs / "selfp" / "prepare" / "conversations.jsonl")
    with open(self_file, "w") as f:
        for c in convs:
            f.write(json.dumps(c.messages[0].content) + "\n")
    rep = json.loads((runs / "selfp" / "prepare" / "report.json").read_text())
    results[key] = {"kept": len(convs), **rep["sources"][0]}
    log(runs, f"selfp: {len(convs)} kept; {rep['sources'][0].get('self_prompts')}")


def _run_arms(runs: Path, args, self_file: str, results: dict, save, chosen: list[str], full: str,
              more_files: list[str]) -> None:
    # 2. the arms' prepare (CPU, parallel) while the probe replies are generated (GPU)
    every = arms(self_file, args.max_rows, more_files, args.weight)
    srcs = {name: every[data_arm(name)] for name in chosen}   # each arm's prepare.sources
    cfgs = {name: write_config(runs, name, {"prepare.sources": srcs[name], "generate.reuse_from": args.reuse_from},
                               args.set)
            for name in chosen}
    data = args.data
    probe_srcs = [{"path": f"{data}/{rel}", "format": fmt, "max_rows": args.probe_prompts}
                  for rel, fmt in PROBE_SETS.values()]
    pc = write_config(runs, "probe", {"prepare.sources": probe_srcs, "prepare.decontaminate": None,
                                      "prepare.near_duplicates": None, "generate.max_new_tokens": 256}, args.set)
    probe_proc = subprocess.Popen(f"{sys.executable} -m eyas.cli prepare {pc} && {sys.executable} -m eyas.cli "
                                  f"generate {pc} && {sys.executable} -m eyas.cli tokenize {pc}", shell=True,
                                  stdout=open(runs / "probe.log", "a"), stderr=subprocess.STDOUT)
    log(runs, "prepare: four arms in parallel; probe replies generating")
    parallel(runs, [("prepare", c) for c in cfgs.values()])
    for name in cfgs:
        rep = json.loads((runs / name / "prepare" / "report.json").read_text())
        results["arms"][name] = {"prepare": {"samples": rep["samples"], "mix": rep["mix"],
                                             "seconds": done(runs / name, "prepare")["seconds"]}}
    save()
    if probe_proc.wait() != 0:
        raise SystemExit("probe run failed (probe.log)")
    log(runs, "prepare done; probe run tokenized")

    # 3. generate: the largest arm in full, the others from it
    eyas("generate", cfgs[full], logfile=runs / f"{full}.log")
    for name in [n for n in chosen if n != full]:
        cfgs[name] = write_config(runs, name, {"prepare.sources": srcs[name],
                                               "generate.reuse_from": [str(runs / full)] + args.reuse_from},
                                  args.set)
        eyas("generate", cfgs[name], logfile=runs / f"{name}.log")
    for name in cfgs:
        results["arms"][name]["generate"] = json.loads((runs / name / "generate" / "report.json").read_text())
    save()
    log(runs, "generate done: " + ", ".join(
        f"{n} {results['arms'][n]['generate'].get('new_tokens_per_s', 'reused')}" for n in cfgs))

    # 4. tokenize, vocab; meanwhile (the GPU is free) the probe of the drafter that train.init_from starts from, the
    # baseline of this run measured in the same job
    toks = [(c, eyas("tokenize", c, wait=False, logfile=runs / f"{c.stem}.log")) for c in cfgs.values()]
    init = (yaml.safe_load(cfgs[full].read_text()).get("train") or {}).get("init_from")
    if init and (results.get("init_probe") or {}).get("drafter") != init:   # not probed by an earlier call
        results["init_probe"] = {"drafter": init, **probe(runs, full, None, drafter=Path(init))}
        save()
        log(runs, "probe of train.init_from's drafter: " + " ".join(
            f"{s} {v['acc'][:3]}" for s, v in results["init_probe"].items() if s != "drafter"))
    bad = [c for c, p in toks if p.wait() != 0]
    if bad:
        raise SystemExit(f"tokenize failed: {bad} (logs under {runs})")
    parallel(runs, [("vocab", c) for c in cfgs.values()])
    for name in cfgs:
        results["arms"][name]["tokenize"] = done(runs / name, "tokenize")
        results["arms"][name]["vocab"] = done(runs / name, "vocab")
    save()

    # 4b. the stores of the arms that train offline (train.mode: offline), one after another on the GPU
    for name, c in cfgs.items():
        if (yaml.safe_load(c.read_text()).get("train") or {}).get("mode") == "offline":
            eyas("extract", c, logfile=runs / f"{name}.log")
            results["arms"][name]["extract"] = done(runs / name, "extract")
            save()
            ex = results["arms"][name]["extract"]
            log(runs, f"extract {name}: {ex['tokens']:,} tokens, {ex['bytes_per_token']} bytes/token, "
                      f"{ex.get('tokens_per_s')} tokens/s" + (f", label mass {ex['label_mass_by_k']}"
                                                               if ex.get("label_mass_by_k") else ""))

    if args.stop_after == "data":   # a call of its own: the replies made and tokenized; `all` again trains
        results["stopped_after"] = "data"
        save()
        log(runs, "stopped after the data (--stop-after data): the same `all` command again trains")
        (runs / "ALL_DONE").write_text("data\n")
        return

    # 5. train: every arm planned for the same tokens, all at once
    procs = {}
    for name in cfgs:
        tokens = results["arms"][name]["tokenize"]["tokens"]
        epochs = round(args.tokens / tokens, 4)
        cfgs[name] = write_config(runs, name, {"prepare.sources": srcs[name],
                                               "generate.reuse_from": ([] if name == full else [str(runs / full)])
                                               + args.reuse_from,
                                               "train.epochs": epochs}, args.set)
        results["arms"][name]["train_epochs"] = epochs
        procs[name] = eyas("train", cfgs[name], wait=False, logfile=runs / f"{name}.log")
    save()
    log(runs, f"train: {len(procs)} arms started, {args.tokens:.3g} tokens each planned")
    if args.all_to_end:
        _all_to_end(runs, args, results, save, cfgs, procs)
        return
    probes: dict[str, dict] = {}
    if len(procs) == 1:   # one arm: nothing to choose, no probe mid-run (it would share the GPU with training)
        probes = {next(iter(procs)): {}}
    asked_to_stop: set[str] = set()
    while len(probes) < len(procs):
        for name, p in procs.items():
            if name in probes:
                continue
            if time.time() - T0 > args.deadline_s and p.poll() is None and name not in asked_to_stop:
                ask_to_stop(runs, name)
                asked_to_stop.add(name)
            ck = [c for c in checkpoints(runs / name) if step_of(c) >= args.probe_step]
            if ck or p.poll() is not None:
                if not ck and p.returncode == 0 and (runs / name / "train" / "done.json").exists():
                    # ended: its drafter (the schedule's end, or where it was asked to stop)
                    probes[name] = {"step": done(runs / name, "train")["steps"], **probe(runs, name, None)}
                else:
                    ck = ck or checkpoints(runs / name)[-1:]
                    probes[name] = {"step": step_of(ck[0]), **probe(runs, name, ck[0])}
                results["arms"][name]["probe"] = probes[name]
                save()
                log(runs, f"probe {name} at step {probes[name]['step']}: "
                          + " ".join(f"{s} {v['acc'][:3]}" for s, v in probes[name].items() if s != "step"))
        time.sleep(5)
    scores = {n: score({k: v for k, v in p.items() if k != "step"}) if len(p) > 1 else None
              for n, p in probes.items()}
    best = max(scores, key=lambda n: scores[n] or 0.0)
    results.update(scores=scores, best=best)
    save()
    log(runs, f"scores {scores}: best {best}; the others are stopped")
    for name, p in procs.items():
        if name != best and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.wait()
    p = procs[best]
    while p.poll() is None:
        if time.time() - T0 > args.deadline_s:
            ask_to_stop(runs, best)
            p.wait()
            break
        time.sleep(5)
    if p.returncode != 0:
        raise SystemExit(f"train {best} exited {p.returncode}")
    results["arms"][best]["train"] = done(runs / best, "train")
    eyas("export", cfgs[best], logfile=runs / f"{best}.log")
    final_probe = ({k: v for k, v in probes[best].items() if k != "step"} if probes[best].get("step") ==
                   results["arms"][best]["train"]["steps"] else probe(runs, best, None))   # probed at its end already
    results["final"] = {"arm": best, "probe": final_probe, "export": done(runs / best, "export")}
    results["ended"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    save()
    log(runs, f"done: {best} {results['final']['probe']}")
    (runs / "ALL_DONE").write_text("ok\n")


def _all_to_end(runs: Path, args, results: dict, save, cfgs: dict, procs: dict) -> None:
    """``--all-to-end``: every arm trains to the end of its schedule (or the deadline) and is exported as it ends;
    then each is probed at its final drafter (an A/B of settings, not a choice of mix)."""
    asked: set[str] = set()
    exported: set[str] = set()
    while any(p.poll() is None for p in procs.values()) or len(exported) < len(procs):
        for name, p in procs.items():   # each arm exported as it ends: a pack before the others end has it
            if p.poll() is not None and name not in exported:
                exported.add(name)
                if p.returncode == 0:
                    eyas("export", cfgs[name], logfile=runs / f"{name}.log")
                    log(runs, f"{name} ended and is exported")
        if time.time() - T0 > args.deadline_s:
            for name, p in procs.items():
                if p.poll() is None and name not in asked:
                    ask_to_stop(runs, name)
                    asked.add(name)
        time.sleep(5)
    failed = {n: p.returncode for n, p in procs.items() if p.returncode != 0}
    for name in procs:
        if name in failed:
            continue
        results["arms"][name]["train"] = done(runs / name, "train")
        results["arms"][name]["probe"] = {"step": results["arms"][name]["train"]["steps"], **probe(runs, name, None)}
        save()
        log(runs, f"probe {name} at its end: " + " ".join(
            f"{s} {v['acc'][:3]}" for s, v in results["arms"][name]["probe"].items() if s != "step"))
    results["ended"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    save()
    if failed:
        raise SystemExit(f"train exited non-zero: {failed} (logs under {runs})")
    log(runs, "done: every arm trained to its end, exported and probed")
    (runs / "ALL_DONE").write_text("ok\n")


def cmd_wait(args) -> None:
    runs = Path(args.runs)
    t = time.time()
    seen = 0
    while time.time() - t < args.max_seconds:
        text = (runs / "mix.log").read_text() if (runs / "mix.log").exists() else ""
        lines = text.splitlines()
        for line in lines[seen:]:
            print(line, flush=True)
        seen = len(lines)
        if (runs / "ALL_DONE").exists() or (runs / "FAILED").exists():
            break
        time.sleep(5)
    for m in sorted(runs.glob("*/train/metrics.jsonl")):   # every arm that has started training
        rows = [json.loads(x) for x in m.read_text().splitlines() if x.strip()]
        if rows:
            r = rows[-1]
            accs = [round(r[f"acc_{k}"], 3) for k in range(3) if f"acc_{k}" in r]
            print(f"{m.parent.parent.name}: step {r['step']} acc {accs} {r.get('recent_tokens_per_s', 0):.0f} tok/s"
                  f" held-out acc_0 {r.get('eval_acc_0')}")
    if (runs / "FAILED").exists():
        print((runs / "FAILED").read_text())


def cmd_pack(args) -> None:
    runs, out = Path(args.runs), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rc = subprocess.run(["tar", "czf", str(out / "mix_runs.tar.gz"), "--exclude=checkpoints", "--exclude=*.safetensors",
                         "--exclude=tensorboard", "--exclude=conversations.jsonl", "--exclude=samples.jsonl",
                         "-C", str(runs), "."]).returncode
    if rc > 1:
        raise SystemExit(f"tar failed ({rc})")
    for name in ("results.json", "mix.log"):
        if (runs / name).exists():
            shutil.copy(runs / name, out / name)
    res = json.loads((runs / "results.json").read_text()) if (runs / "results.json").exists() else {}
    best = res.get("best")
    made = best or res.get("full")          # the arm whose replies were generated (before training: `full`)
    conv = runs / (made or "") / "generate" / "conversations.jsonl"
    if made and conv.exists() and not args.no_conversations:
        # the target's replies, for generate.reuse_from in a later run (xz, in files of at most 16 MiB, what a
        # device call brings back)
        xz = out / f"{made}_conversations.jsonl.xz"
        with open(xz, "wb") as f:
            subprocess.run(["xz", "-T0", "-6", "-c", str(conv)], stdout=f, check=True)
        _split_over_limit(xz)                  # parts .00, .01, ...: `cat` them back (bench/mix.sh prev)
    for arm in (args.drafters.split(",") if args.drafters else [best] if best else []):
        # drafter_<file> for the best, <arm>_<file> if named; the SGLang folder where there is one, else the vLLM
        # one (a draft of more than one decoder layer is exported for vLLM only)
        folders = [runs / arm / "export" / e for e in ("sglang", "vllm") if (runs / arm / "export" / e).exists()]
        if folders:
            for f in sorted(folders[0].glob("*.safetensors")):
                dest = out / (f"{arm}_{f.name}" if args.drafters else f"drafter_{f.name}")
                shutil.copy(f, dest)
                _split_over_limit(dest)        # a shard holding one tensor over 16 MiB (a 32K-id lm_head): parts
    for f in sorted(out.iterdir()):
        print(f"{f.name}: {f.stat().st_size:,} bytes")


def _split_over_limit(path: Path, limit: int = 16 * 2**20) -> None:
    """A file over ``limit`` bytes (what one file back from a device call may hold) is replaced by its parts
    ``PATH.00``, ``PATH.01``, ...; ``cat PATH.* > PATH`` joins them (``bench/mix.sh join``)."""
    if path.stat().st_size > limit:
        subprocess.run(["split", "-b", str(limit), "-d", "-a", "2", str(path), f"{path}."], check=True)
        path.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["all", "wait", "pack", "probe"])
    ap.add_argument("--runs", default=os.environ.get("MIX_RUNS", str(REPO / "runs" / "mix")))
    ap.add_argument("--data", default=os.environ.get("MIX_DATA", ".hdata"))
    ap.add_argument("--set", action="append", default=[], help="key=value applied to every arm's config")
    ap.add_argument("--arms", default="a,b,c10,c30", help="the arms to run (comma-separated)")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=ARM:key=value;key=value: one more arm, trained on ARM's data (its replies reused, "
                         "nothing regenerated) with these settings on top of --set (e.g. a wider draft)")
    ap.add_argument("--no-conversations", action="store_true",
                    help="pack: leave the best arm's replies out (a later call packs them)")
    ap.add_argument("--conversations", action="store_true",
                    help="pack: the replies in (the default; for `PACK=--conversations bench/mix.sh one`)")
    ap.add_argument("--tokens", type=float, default=52e6, help="training tokens planned per arm")
    ap.add_argument("--all-to-end", action="store_true",
                    help="every arm trains to its end, then each is exported and probed (no choice, no early stop)")
    ap.add_argument("--drafters", default=None,
                    help="pack: these arms' exported weight files as <arm>_<file> (default: the best arm's)")
    ap.add_argument("--probe-step", type=int, default=600)
    ap.add_argument("--probe-prompts", type=int, default=80)
    ap.add_argument("--self-prompts", type=int, default=45000, help="self-prompts asked")
    ap.add_argument("--self-prompts-file", default=None,
                    help="the c arms' self-prompts from this prompts file (JSONL of strings, compressed or not) "
                         "instead of writing them (e.g. bench/results/mix/warm/self_prompts.jsonl.xz)")
    ap.add_argument("--more-self-prompts", type=int, default=0,
                    help="arm d: this many new self-prompts asked beside --self-prompts-file's (and beside "
                         "--more-self-prompts-file's, when both are given)")
    ap.add_argument("--more-self-prompts-file", action="append", default=[],
                    help="arm d: new prompts from this prompts file instead of sampling them (an earlier run's, "
                         "e.g. the steered set of bench/results/mix/steered/); kept whole under --weight; "
                         "repeatable")
    ap.add_argument("--self-prompt-seed", type=int, default=0, help="prepare.self_prompts.seed of the sampling")
    ap.add_argument("--self-prompt-systems", default=None,
                    help="prepare.self_prompts.system_prompts from this JSON file (a list of system messages, null "
                         "for the template's default; e.g. bench/self_prompt_systems.json): the sampled prompts "
                         "steered to those kinds")
    ap.add_argument("--self-prompt-tokens", type=int, default=256, help="a longer self-prompt is dropped")
    ap.add_argument("--max-rows", type=int, default=None, help="rows read per file (the CPU check)")
    ap.add_argument("--weight", type=float, default=None,
                    help="prepare's seeded share of every source's conversations (e.g. 0.25: a quarter of the mix), "
                         "but the --more-self-prompts sampled in this run, which are kept whole")
    ap.add_argument("--reuse-from", action="append", default=[],
                    help="a run folder (or a copy of its generate stage) whose replies the arms reuse "
                         "(generate.reuse_from; not the probe run, which generates 256 tokens)")
    ap.add_argument("--stop-after", choices=["data"], default=None,
                    help="end once every arm's data is tokenized and its vocabulary made (one device call); the "
                         "same `all` command without it then skips what is done and trains (the next call)")
    ap.add_argument("--deadline-s", type=float, default=1260, help="seconds after start at which training stops")
    ap.add_argument("--max-seconds", type=float, default=560)
    ap.add_argument("--arm", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", str(REPO / "runs" / "out")))
    args = ap.parse_args()
    if args.command == "all":
        try:
            cmd_all(args)
        except BaseException as e:  # the waiting calls must see that it ended
            Path(args.runs, "FAILED").write_text(f"{type(e).__name__}: {e}\n")
            raise
    elif args.command == "probe":
        print(json.dumps(probe(Path(args.runs), args.arm, None)))
    else:
        {"wait": cmd_wait, "pack": cmd_pack}[args.command](args)


if __name__ == "__main__":
    main()
