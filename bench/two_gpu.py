"""Two GPUs against one (issue 15): FSDP2 training of a draft and data-parallel extraction, each measured against
one process on one of the same GPUs, plus a kill of one rank and a resume; ``bench/two_gpu.sh`` runs every step in
one device call and ``report`` writes the figures.

Training (``train``, run once per process count; under ``torchrun`` each rank takes ``cuda:LOCAL_RANK``): the
draft of ``--shape`` (bench/train_step.py's shapes; random weights seeded alike on every rank, random bf16 states in
an Eyas store on disk written by ``store``) trained by :func:`eyas.train.loop.train` itself, ``--batch`` sequences
of ``--seq`` tokens per process a step. Tokens/s: the median of the loop's per-step rate (all ranks' tokens over
the step's wall time) after the warm-up steps. The loss check: 2 processes x batch B against 1 process x batch 2B
(the same global batches; equal within bf16 noise on a GPU, exactly equal in fp32 on the CPU).

Extraction (``bench/two_gpu.sh``): ``eyas extract`` of one tokenized run by 1 process and by ``torchrun
--nproc-per-node 2``, a random-weights Llama-shaped target (``target``); ``compare-stores`` checks the stores
sample by sample.

    python bench/two_gpu.py store  --dir D --shape llama31_8b --seq 2048 --samples 64
    python bench/two_gpu.py train  --dir D --shape llama31_8b --seq 2048 --batch 1 --tag one
    torchrun --nproc-per-node 2 bench/two_gpu.py train --dir D --shape llama31_8b --seq 2048 --batch 1 --tag two
    python bench/two_gpu.py report --dir D
    bench/two_gpu.sh cpu-check        # every step at a tiny scale, 2 gloo processes on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import train_loop  # noqa: E402
import train_step  # noqa: E402

from eyas.config import TrainConfig  # noqa: E402
from eyas.model.eagle3 import Eagle3Config  # noqa: E402
from eyas.records import TokenizedSample  # noqa: E402
from eyas.store import HiddenStateStore  # noqa: E402
from eyas.train.data import SampleDataset  # noqa: E402
from eyas.train.loop import train  # noqa: E402

SHAPES = {"llama31_8b": train_step.LLAMA31_8B, "smollm2": train_step.SMOLLM2, "tiny": train_step.TINY}
LOSS_STEPS = 20


def cmd_store(args) -> None:
    """Random states for ``--samples`` sequences of ``--seq`` tokens, and their records (``samples.jsonl``)."""
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    samples = train_loop.write_store(d / "store", Eagle3Config(**SHAPES[args.shape]), args.seq, args.samples)
    with open(d / "samples.jsonl", "w") as f:
        for s in samples:
            f.write(json.dumps({"id": s.id, "ids": s.input_ids, "mask": s.loss_mask}) + "\n")
    print(f"store: {len(samples)} samples of {args.seq} tokens in {d / 'store'}")


def cmd_train(args) -> None:
    """One training run (this process's share under torchrun); rank 0 writes ``TAG.json``, every rank
    ``TAG.rankR.json`` (its peak memory)."""
    d = Path(args.dir)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available() and args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    cfg = Eagle3Config(**SHAPES[args.shape])
    attention = args.attention if cuda else "sdpa"   # flex has no backward on the CPU
    torch.manual_seed(0)                      # the same initial draft on every rank and in every run
    model, data, _, _ = train_step.build(cfg, args.seq, device, attention)
    head = data["head"]
    del data
    rows = [json.loads(x) for x in (d / "samples.jsonl").read_text().splitlines()]
    samples = [TokenizedSample(r["id"], r["ids"], r["mask"]) for r in rows]
    steps = args.warmup + args.iters
    tc = TrainConfig(ttt_steps=args.ttt, epochs=steps * args.batch * world / len(samples), lr=1e-4,
                     batch_size=args.batch, checkpoint_every=args.checkpoint_every, log_every=10 ** 6,
                     tensorboard=False, attention=attention, device=str(device), max_length=args.seq,
                     distributed=args.distributed, compile=None if cuda else False)
    out = d / args.tag
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.time()
    res = train(model, SampleDataset(samples, args.seq, HiddenStateStore.open(d / "store")), head, tc, out, device,
                {}, log=print if rank == 0 else (lambda m: None))
    wall = time.time() - t0
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if cuda else None
    (d / f"{args.tag}.rank{rank}.json").write_text(json.dumps({"rank": rank, "peak_gb": peak}))
    if rank == 0:
        m = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        rates = [r["recent_tokens_per_s"] for r in m[args.warmup:]] or [r["recent_tokens_per_s"] for r in m]
        res_json = {"tag": args.tag, "world": world, "batch_per_process": args.batch, "seq": args.seq,
                    "shape": args.shape, "strategy": args.distributed if world > 1 else "single",
                    "steps": res.steps, "tokens_per_s": round(statistics.median(rates), 1), "wall_s": round(wall, 1),
                    "losses": [r["loss"] for r in m[:LOSS_STEPS]],
                    "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__}
        (d / f"{args.tag}.json").write_text(json.dumps(res_json, indent=1))
        print(json.dumps({k: v for k, v in res_json.items() if k != "losses"}))


def _descendants(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(p.name))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def cmd_kill(args) -> None:
    """Run ``args.cmd`` (a torchrun command); once ``--when`` exists and holds at least ``--lines`` complete lines (a
    store manifest is created empty when its writer opens, before any shard is committed), ``kill -9`` its worker
    with RANK=``--rank``; the command must then fail. Writes ``--log``."""
    proc = subprocess.Popen(args.cmd, stdout=open(args.log, "w"), stderr=subprocess.STDOUT)
    when = Path(args.when)
    deadline = time.time() + args.timeout
    def ready() -> bool:
        try:
            return when.read_bytes().count(b"\n") >= args.lines if args.lines else when.exists()
        except OSError:
            return False

    while proc.poll() is None and time.time() < deadline and not ready():
        time.sleep(0.02)
    if proc.poll() is not None:
        raise SystemExit(f"kill: the run ended before {when} appeared (exit {proc.returncode}); see {args.log}")
    victim = None
    for pid in _descendants(proc.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={args.rank}".encode() in env and any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in env):
            victim = pid
            break
    if victim is None:
        proc.kill()
        raise SystemExit("kill: no worker with that rank found")
    os.kill(victim, signal.SIGKILL)
    rc = proc.wait(timeout=600)
    print(f"kill: rank {args.rank} (pid {victim}) killed once {when.name} existed; torchrun exited {rc}")
    if rc == 0:
        raise SystemExit("kill: torchrun did not fail after a rank was killed")


def cmd_compare_weights(args) -> None:
    """The final checkpoints of two ``train`` runs, tensor by tensor (exit 1 when they differ)."""
    from safetensors.torch import load_file

    def final(tag):
        ck = sorted((Path(args.dir) / tag / "checkpoints").glob("step-*"))
        return ck[-1].name, load_file(str(ck[-1] / "draft.safetensors"))

    (sa, a), (sb, b) = final(args.a), final(args.b)
    same = sa == sb and set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    res = {"a": args.a, "b": args.b, "step_a": sa, "step_b": sb, "bit_equal": same}
    (Path(args.dir) / f"weights_{args.a}_{args.b}.json").write_text(json.dumps(res))
    print(json.dumps(res))
    if not same:
        raise SystemExit(1)


def cmd_target(args) -> None:
    """A random-weights Llama-shaped target folder with the tokenizer of ``--tokenizer-from``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(args.tokenizer_from)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=len(tok),
                      max_position_embeddings=8192, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"target: {n / 1e9:.2f}B parameters, hidden {args.hidden}, {args.layers} layers -> {args.out}")


def cmd_compare_stores(args) -> None:
    """Two stores of the same run sample by sample: checksums, else tensors within one bf16 step."""
    a, b = HiddenStateStore.open(Path(args.a)), HiddenStateStore.open(Path(args.b))
    ia, ib = set(a.ids()), set(b.ids())
    res = {"samples_a": len(ia), "samples_b": len(ib), "same_ids": ia == ib, "checksum_equal": 0, "close": 0,
           "differ": 0}
    for sid in sorted(ia & ib):
        if a.entry(sid).checksum == b.entry(sid).checksum:
            res["checksum_equal"] += 1
            continue
        x, y = a.read(sid), b.read(sid)
        ok = torch.equal(x.input_ids, y.input_ids) and all(
            torch.allclose(p.float(), q.float(), rtol=2 ** -7, atol=1e-6) for p, q in ((x.aux, y.aux), (x.last, y.last)))
        res["close" if ok else "differ"] += 1
    Path(args.out).write_text(json.dumps(res))
    print(json.dumps(res))
    if not res["same_ids"] or res["differ"]:
        raise SystemExit(1)


def _extract_rate(run: Path) -> dict:
    done = json.loads((run / "extract" / "done.json").read_text())
    s = done["summary"]
    return {"tokens": s["tokens"], "tokens_per_s": s["tokens_per_s"], "stage_s": done["seconds"], "ranks": s["ranks"]}


def cmd_report(args) -> None:
    """The figures and the lines BENCHMARKS.md carries, from what the other commands wrote."""
    d = Path(args.dir)
    out: dict = {}

    def load(name):
        p = d / name
        return json.loads(p.read_text()) if p.exists() else None

    one, two, ref = load("one.json"), load("two.json"), load("one_b2.json")
    if one and two:
        peaks = {t: [load(f"{t}.rank{r}.json")["peak_gb"] for r in range(w)] for t, w in (("one", 1), ("two", 2))}
        out["train"] = {"one": one, "two": two, "ratio": round(two["tokens_per_s"] / one["tokens_per_s"], 3),
                        "peak_gb": peaks}
        print(f"training, {one['shape']} draft, {one['seq']} tokens x {one['batch_per_process']} per GPU: "
              f"1 GPU {one['tokens_per_s']:.0f} tokens/s, 2 GPUs ({two['strategy']}) {two['tokens_per_s']:.0f}; "
              f"peak memory per GPU {peaks}")
        print(f"two-GPU training ratio: {out['train']['ratio']:.2f}x")
    if two and ref:
        n = min(len(two["losses"]), len(ref["losses"]))
        rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(two["losses"][:n], ref["losses"][:n])]
        out["loss_check"] = {"steps": n, "max_rel_diff": max(rel) if rel else None,
                             "two": two["losses"][:n], "one_double_batch": ref["losses"][:n]}
        print(f"loss, first {n} steps, 2 GPUs x B against 1 GPU x 2B: max relative difference {max(rel):.2e}")
    runs = d / "extract_runs"
    if (runs / "x1" / "extract" / "done.json").exists() and (runs / "x2" / "extract" / "done.json").exists():
        x1, x2 = _extract_rate(runs / "x1"), _extract_rate(runs / "x2")
        out["extract"] = {"one": x1, "two": x2, "ratio": round(x2["tokens_per_s"] / x1["tokens_per_s"], 3),
                          "stores": load("stores_x1_x2.json")}
        print(f"extraction: 1 GPU {x1['tokens_per_s']:.0f} tokens/s, 2 GPUs {x2['tokens_per_s']:.0f} "
              f"({x1['tokens']} tokens; stage wall {x1['stage_s']:.0f} s / {x2['stage_s']:.0f} s)")
        print(f"two-GPU extraction ratio: {out['extract']['ratio']:.2f}x")
    for f in ("weights_two_killed.json", "stores_x1_x3.json"):
        if load(f):
            out[f.removesuffix(".json")] = load(f)
    (d / "report.json").write_text(json.dumps(out, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("store", "train"):
        p = sub.add_parser(name)
        p.add_argument("--dir", required=True)
        p.add_argument("--shape", default="llama31_8b", choices=list(SHAPES))
        p.add_argument("--seq", type=int, default=2048)
        p.add_argument("--samples", type=int, default=64)
        p.add_argument("--batch", type=int, default=1, help="sequences per process a step")
        p.add_argument("--tag", default="one")
        p.add_argument("--ttt", type=int, default=7)
        p.add_argument("--warmup", type=int, default=6)
        p.add_argument("--iters", type=int, default=24)
        p.add_argument("--attention", default="flex")
        p.add_argument("--distributed", default="fsdp", choices=["ddp", "fsdp"])
        p.add_argument("--checkpoint-every", type=int, default=10 ** 6)
        p.add_argument("--device", default="cuda")
    p = sub.add_parser("kill")
    p.add_argument("--when", required=True, help="a path; the rank is killed once it exists")
    p.add_argument("--lines", type=int, default=0, help="... and holds this many complete lines (0: exists)")
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--log", required=True)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    p = sub.add_parser("compare-weights")
    p.add_argument("--dir", required=True)
    p.add_argument("--a", required=True)
    p.add_argument("--b", required=True)
    p = sub.add_parser("target")
    p.add_argument("--tokenizer-from", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p = sub.add_parser("compare-stores")
    p.add_argument("--a", required=True)
    p.add_argument("--b", required=True)
    p.add_argument("--out", required=True)
    p = sub.add_parser("report")
    p.add_argument("--dir", required=True)
    args = ap.parse_args()
    if getattr(args, "cmd", None) and args.cmd[0] == "--":
        args.cmd = args.cmd[1:]
    {"store": cmd_store, "train": cmd_train, "kill": cmd_kill, "compare-weights": cmd_compare_weights,
     "target": cmd_target, "compare-stores": cmd_compare_stores, "report": cmd_report}[args.command](args)


if __name__ == "__main__":
    main()
