"""The field's reference trainer (SpecForge v0.2.0), one training step timed as ``bench/train_step.py`` times Eyas's.

Issue 13 asks for Eyas's step against the reference's, side by side in one device call. This harness imports a
fetched copy of SpecForge from an ignored folder and keeps none of its code. Fetch it once, on a machine with
network (it is pure Python, 0.6 MB, carried to the device with the checkout's ignored paths):

    git clone https://github.com/sgl-project/SpecForge /tmp/SpecForge
    mkdir -p .ref/SpecForge
    git -C /tmp/SpecForge archive 73e6f808 specforge scripts LICENSE | tar -x -C .ref/SpecForge

(73e6f808 is "bump version to v0.2.0", the tag's commit; ``bench/step_vs_reference.sh ref GITDIR`` does the same
from any local clone.)

**What is timed** is the reference script's offline step (``scripts/train_eagle3.py``: ``run_forward`` with
``is_online=False`` and ``run_backward_and_update``), built the way its ``main`` builds it:

- the draft: ``LlamaForCausalLMEagle3`` made in bf16 (``AutoEagle3DraftModel.from_config(..., torch_dtype=bf16)``),
  flex attention, its embedding frozen; ``OnlineEagle3Model(length=K)`` wrapped in FSDP (one rank,
  ``SHARD_GRAD_OP``, ``MixedPrecision(param_dtype=bf16)``, ``use_orig_params``), as the script does;
- soft labels: ``TargetHead`` (the target lm_head, bf16, frozen) on the stored last hidden state, then
  ``TargetHead.preprocess``;
- the loss ``sum_k 0.8**k * ploss_k``, backward, and ``BF16Optimizer.step`` (fp32 master weights, AdamW, gradient
  clipping at 0.5, cosine schedule).

Inputs are on the GPU, weights random (the same shapes as ``bench/train_step.py``), batch 1, every position an
assistant token. The median of ``--iters`` steps after ``--warmup``, CUDA events; peak memory is
``torch.cuda.max_memory_allocated`` over the timed steps. The reference's package ``__init__`` files import its
SGLang target backends, which the device lacks; the harness registers the package folders without running those
``__init__`` files and imports only the modules the step uses.

``--device cpu`` is a check of the harness itself, not a timing: the reference's loss is a Triton kernel, so on a
CPU it is replaced by the same formula in PyTorch (``-sum(mask * p * log_softmax(logits)) / (B*T)``, the
reference's own ``_compute_loss``), its SDPA attention backend stands in for flex attention (whose backward has no
CPU kernel) and FSDP is left out (FSDP1 needs a GPU).

    python3 bench/reference_step.py --shape llama31-8b --seq 2048 8192 --out ref.json
    python3 bench/reference_step.py --device cpu --tiny               # seconds; checks the harness
    python3 bench/reference_step.py report --eyas eyas.json --ref ref.json    # the side-by-side lines
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from train_step import SHAPES, flops_per_token, peak_memory, warm_and_time  # noqa: E402

REF_COMMIT = "73e6f808"


def import_reference(root: Path, cpu_loss: bool) -> dict:
    """The reference's modules the offline step uses, from a fetched copy at ``root`` (its ``specforge/`` inside).

    Raises ``FileNotFoundError`` naming the fetch command when the copy is missing."""
    pkg = root / "specforge"
    if not (pkg / "core" / "eagle3.py").is_file():
        raise FileNotFoundError(f"no SpecForge copy at {root} (expected {pkg}/core/eagle3.py); fetch it as this "
                                f"script's docstring says (commit {REF_COMMIT})")
    for name in ("specforge", "specforge.core", "specforge.modeling", "specforge.modeling.target"):
        mod = types.ModuleType(name)
        mod.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules[name] = mod
    if cpu_loss:   # the harness check on a CPU: the Triton loss kernel replaced by its formula
        loss_mod = types.ModuleType("specforge.core.loss")

        class LogSoftmaxLoss:
            @staticmethod
            def apply(logits, target, position_mask):
                logp = torch.log_softmax(logits.float(), dim=-1)
                return -(position_mask * target * logp).sum(-1).mean()

        loss_mod.LogSoftmaxLoss = LogSoftmaxLoss
        sys.modules["specforge.core.loss"] = loss_mod
    sys.path.insert(0, str(root))
    return {
        "eagle3": importlib.import_module("specforge.core.eagle3"),
        "draft": importlib.import_module("specforge.modeling.draft.llama3_eagle"),
        "head": importlib.import_module("specforge.modeling.target.target_head"),
        "optimizer": importlib.import_module("specforge.optimizer"),
    }


def llama_config(shape: dict):
    """The reference's draft config (a transformers ``LlamaConfig`` with ``draft_vocab_size``) for an Eyas shape."""
    from transformers import LlamaConfig

    rope = dict(shape.get("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0}))
    kw = dict(hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
              num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_key_value_heads"],
              head_dim=shape["head_dim"], vocab_size=shape["vocab_size"], num_hidden_layers=1,
              max_position_embeddings=shape.get("max_position_embeddings", 4096), hidden_act="silu",
              rms_norm_eps=shape.get("rms_norm_eps", 1e-6), tie_word_embeddings=False, pad_token_id=0)
    cfg = LlamaConfig(**kw, rope_parameters=rope)
    cfg.draft_vocab_size = shape["draft_vocab_size"]
    # The reference reads ``rope_scaling`` (transformers 4); transformers 5 keeps ``rope_parameters``.
    cfg.rope_scaling = None if rope.get("rope_type", "default") == "default" else rope
    cfg.rope_theta = rope.get("rope_theta", 10000.0)
    return cfg


def build(mods: dict, shape: dict, T: int, K: int, device: torch.device, fsdp: bool, attention: str, seed: int = 0,
          batch: int = 1):
    """The reference's draft, FSDP-wrapped TTT model, target head, optimizer and inputs; see the docstring."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    cfg = llama_config(shape)
    draft = mods["draft"].LlamaForCausalLMEagle3(cfg, attention_backend=attention).to(torch.bfloat16)
    draft = draft.to(device)
    V, Dv, Ht = shape["vocab_size"], shape["draft_vocab_size"], shape["target_hidden_size"]
    draft_ids = torch.randperm(V, generator=g)[:Dv].sort().values
    with torch.no_grad():
        draft.embed_tokens.weight.normal_(0, 0.02)
        draft.t2d.zero_()
        draft.t2d[draft_ids.to(device)] = True
        draft.d2t.copy_((draft_ids - torch.arange(Dv)).to(device))
    draft.freeze_embedding()
    model = mods["eagle3"].OnlineEagle3Model(draft_model=draft, length=K, attention_backend=attention)
    if fsdp:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

        model = FSDP(model, use_orig_params=True, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
                     mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16),
                     process_group=torch.distributed.group.WORLD)
    with tempfile.TemporaryDirectory() as d:   # TargetHead reads a config; its weights are random here
        Path(d, "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": Ht, "vocab_size": V}))
        head = mods["head"].TargetHead(d)
    with torch.no_grad():
        head.fc.weight.copy_(torch.randn(V, Ht, generator=g) * 0.02)
    head.freeze_weights()
    head = head.eval().to(device).to(torch.bfloat16)
    opt = mods["optimizer"].BF16Optimizer(draft, lr=1e-4, max_grad_norm=0.5, total_steps=1000)
    data = {
        "input_ids": torch.randint(0, V, (batch, T), generator=g).to(device),
        "attention_mask": torch.ones(batch, T, dtype=torch.int64, device=device),
        "loss_mask": torch.ones(batch, T, dtype=torch.int64, device=device),
        "hidden_state": torch.randn(batch, T, 3 * Ht, generator=g).to(device, torch.bfloat16),
        "target": torch.randn(batch, T, Ht, generator=g).to(device, torch.bfloat16),
    }
    return model, head, opt, data


def make_step(model, head, opt, data):
    """One step as ``scripts/train_eagle3.py`` runs it offline (``run_forward`` + ``run_backward_and_update``)."""
    def step():
        target = head(data["target"])
        input_ids, target, loss_mask = head.preprocess(data["input_ids"], target, data["loss_mask"])
        plosses, _, _ = model(input_ids=input_ids, attention_mask=data["attention_mask"], loss_mask=loss_mask,
                              target=target, hidden_states=data["hidden_state"])
        loss = sum(0.8 ** i * p for i, p in enumerate(plosses))
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def measure(mods: dict, shape_name: str, T: int, K: int, device: torch.device, warmup: int, iters: int,
            batch: int = 1) -> dict:
    """Tokens/s, step time and peak memory of the reference's step at sequence length ``T``, ``batch`` sequences a
    step (its ``--batch-size``; 1 is its default)."""
    shape = SHAPES[shape_name]
    attention = "flex_attention" if device.type == "cuda" else "sdpa"
    model, head, opt, data = build(mods, shape, T, K, device, fsdp=device.type == "cuda", attention=attention,
                                   batch=batch)
    step = make_step(model, head, opt, data)
    loss, warm_s, times = warm_and_time(step, device, warmup, iters)
    if not math.isfinite(float(loss)):
        raise RuntimeError(f"non-finite loss {float(loss)}")
    med = times[len(times) // 2]
    from eyas.model.eagle3 import Eagle3Config

    dense, attn = flops_per_token(Eagle3Config(**shape), T, K)
    out = {"trainer": f"specforge-v0.2.0 ({REF_COMMIT})", "shape": shape_name, "seq": T, "batch": batch,
           "ttt_steps": K, "attention": attention, "step_ms": round(med * 1e3, 2),
           "step_ms_min": round(times[0] * 1e3, 2), "tokens_per_s": round(batch * T / med, 1),
           "tflops_per_s": round(batch * T * (dense + attn) / med / 1e12, 1),
           "warmup_s": round(warm_s, 1), "iters": iters, "loss": round(float(loss), 4), **peak_memory(device)}
    del model, head, opt, data, step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _init_single_rank(device: torch.device) -> None:
    """The reference runs under torch.distributed (FSDP, its ``print_with_rank``): one rank here."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(0)


def report(eyas_path: Path, ref_path: Path) -> list[str]:
    """Side-by-side rows and the issue's lines from ``bench/train_step.py --out`` and this script's ``--out``.

    One sequence a step (batch 1): rows match on (shape, seq); Eyas's bf16 row is its fastest error-free
    configuration with ``fp8`` and ``fp8_lm_head`` off there, its fp8 row the fastest with either on (when
    measured), and the issue's ``train-step ratio`` lines take the faster of the two. At equal memory (rows with
    several batch sizes at 2,048 tokens): the reference's fastest batch that ran sets the memory, Eyas's fastest
    configuration within that peak memory is set against it. Returns the printed lines. Raises ``ValueError``
    when no row pairs up."""
    eyas = [r for r in json.loads(eyas_path.read_text())["rows"] if "error" not in r]
    ref = [r for r in json.loads(ref_path.read_text())["rows"] if "error" not in r]
    nan = float("nan")

    def best(rows: list[dict]) -> dict | None:
        return max(rows, key=lambda x: x["tokens_per_s"]) if rows else None

    lines = ["| shape | seq | reference tokens/s | Eyas tokens/s (bf16) | ratio | Eyas tokens/s (fp8) | ratio | "
             "peak GB (ref / Eyas bf16 / Eyas fp8) | memory ratio |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    tail = []
    for r in [r for r in ref if r.get("batch", 1) == 1]:
        at = [e for e in eyas if e.get("shape", "llama31-8b") == r["shape"] and e["seq"] == r["seq"]
              and e.get("batch", 1) == 1]
        low = [e for e in at if e.get("fp8", "off") != "off" or e.get("fp8_lm_head")]   # any product in fp8
        e16 = best([e for e in at if e not in low])
        e8 = best(low)
        e = best([x for x in (e16, e8) if x])
        if e is None:
            continue
        ratio = e["tokens_per_s"] / r["tokens_per_s"]
        mem = e.get("peak_gb", nan) / r.get("peak_gb", nan)
        c16 = f"{e16['tokens_per_s']:,.0f} | {e16['tokens_per_s'] / r['tokens_per_s']:.2f}x" if e16 else "- | -"
        c8 = (f"{e8['tokens_per_s']:,.0f} ({fp8_label(e8)}) | {e8['tokens_per_s'] / r['tokens_per_s']:.2f}x" if e8
              else "- | -")
        lines.append(f"| {r['shape']} | {r['seq']:,} | {r['tokens_per_s']:,.0f} | {c16} | {c8} | "
                     f"{r.get('peak_gb', nan):.1f} / {(e16 or {}).get('peak_gb', nan):.1f} / "
                     f"{(e8 or {}).get('peak_gb', nan):.1f} | {mem:.2f} |")
        if r["shape"] == "llama31-8b" and r["seq"] in (2048, 8192):
            tail.append(f"train-step ratio to reference at {r['seq'] // 1024}K: {ratio:.2f}x, "
                        f"peak memory ratio {mem:.2f}")
    if len(lines) == 2:
        raise ValueError(f"no (shape, seq) in both {eyas_path} and {ref_path}")
    equal = {}
    table = ["", "| shape | reference: best batch (tokens/s, peak GB) | Eyas within that memory: batch, fp8 (tokens/s, "
             "peak GB) | ratio |", "|---|---|---|---:|"]

    def peak(x: dict) -> float:
        """Peak GPU memory in GB (a CPU check has RSS only)."""
        return x.get("peak_gb", x.get("peak_rss_gb", nan))

    for shape in sorted({r["shape"] for r in ref if r.get("batch", 1) > 1}):
        seq = max(r["seq"] for r in ref if r["shape"] == shape and r.get("batch", 1) > 1)   # 2,048 on the GPU
        r = best([x for x in ref if x["shape"] == shape and x["seq"] == seq])
        fit = best([e for e in eyas if e.get("shape", "llama31-8b") == shape and e["seq"] == seq
                    and peak(e) <= peak(r)])
        if fit is None:
            continue
        equal[shape] = fit["tokens_per_s"] / r["tokens_per_s"]
        table.append(f"| {shape} | {r.get('batch', 1)} ({r['tokens_per_s']:,.0f}, {peak(r):.1f}) | "
                     f"{fit.get('batch', 1)}, {fp8_label(fit)} ({fit['tokens_per_s']:,.0f}, "
                     f"{peak(fit):.1f}) | {equal[shape]:.2f}x |")
    if equal:
        lines += table
        tail.append("training throughput ratio to reference on 2K samples at equal memory: "
                    f"{equal.get('llama31-8b', nan):.2f}x (Llama-3.1-8B), {equal.get('kimi-k2', nan):.2f}x (Kimi-K2)")
    return lines + [""] + tail


def fp8_label(row: dict) -> str:
    """What ran in fp8 in an Eyas row: ``train.fp8``'s recipe, and ``+ fp8 lm_head`` (``train.fp8_lm_head``)."""
    return row.get("fp8", "off") + (" + fp8 lm_head" if row.get("fp8_lm_head") else "")


def agree(root: Path, T: int = 48, K: int = 7, attention: str = "flex_attention", seed: int = 0) -> dict:
    """Eyas's TTT against the reference's on the same weights and inputs, fp32 on the CPU (SDPA backend).

    The tiny shape with default RoPE; both drafts hold the same random weights (the key names are equal), the same
    draft vocabulary and target lm_head; every position is an assistant token. Per TTT step k it compares the
    pre-norm hidden state (Eyas's ``forward`` output against what the reference hands ``compute_logits``), the soft
    labels and the mask of counted positions (Eyas's ``target_labels`` against what the reference hands its loss),
    over positions t < T-1-k (later ones hold padding in both). Returns the largest differences and the positions
    where the masks differ, by step."""
    from eyas.model.eagle3 import Eagle3Config, Eagle3DraftModel
    from eyas.train.loss import target_labels

    _init_single_rank(torch.device("cpu"))
    mods = import_reference(root, cpu_loss=True)
    seen = {"hidden": [], "loss_in": []}
    loss_mod = sys.modules["specforge.core.loss"]

    class Recording:
        @staticmethod
        def apply(logits, target, position_mask):
            seen["loss_in"].append((target.detach(), position_mask.detach()))
            return loss_mod.LogSoftmaxLoss.apply(logits, target, position_mask)

    mods["eagle3"].LogSoftmaxLoss = Recording
    shape = dict(SHAPES["tiny"])
    g = torch.Generator(device="cpu").manual_seed(seed)
    ref = mods["draft"].LlamaForCausalLMEagle3(llama_config(shape), attention_backend=attention).float()
    V, Dv, H = shape["vocab_size"], shape["draft_vocab_size"], shape["hidden_size"]
    draft_ids = torch.randperm(V, generator=g)[:Dv].sort().values
    with torch.no_grad():
        for prm in ref.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g) * 0.1 + (1.0 if prm.ndim == 1 else 0.0))
        ref.t2d.zero_()
        ref.t2d[draft_ids] = True
        ref.d2t.copy_(draft_ids - torch.arange(Dv))
    compute_logits = ref.compute_logits

    def recording_logits(hidden):
        seen["hidden"].append(hidden.detach())
        return compute_logits(hidden)

    ref.compute_logits = recording_logits
    mine = Eagle3DraftModel(Eagle3Config(**shape)).float()
    missing, unexpected = mine.load_state_dict(ref.state_dict(), strict=False)
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise RuntimeError(f"key tables differ: missing {missing}, unexpected {unexpected}")
    ids = torch.randint(0, V, (1, T), generator=g)
    aux = torch.randn(1, T, 3 * H, generator=g)
    last = torch.randn(1, T, H, generator=g)
    head = torch.randn(V, H, generator=g)
    loss_mask = torch.ones(1, T, dtype=torch.int64)

    with torch.no_grad():
        target = last @ head.T                                    # the TargetHead, fp32
        r_ids, r_target, r_mask = mods["head"].TargetHead.preprocess(None, ids, target, loss_mask)  # no self use
        model = mods["eagle3"].OnlineEagle3Model(draft_model=ref, length=K, attention_backend=attention)
        model(input_ids=r_ids, attention_mask=torch.ones(1, T, dtype=torch.int64), loss_mask=r_mask,
              target=r_target, hidden_states=aux)
        hiddens = mine(ids, aux, K)
        labels = target_labels(last, head, draft_ids, mine.t2d, loss_mask)
    out = {"attention": attention, "T": T, "ttt_steps": K,
           "hidden_max_abs_diff": [], "label_max_abs_diff": [], "mask_differs_at": []}
    for k in range(K):
        n = T - 1 - k
        out["hidden_max_abs_diff"].append(float((hiddens[k][:, :n] - seen["hidden"][k][:, :n]).abs().max()))
        r_p, r_m = seen["loss_in"][k]
        out["label_max_abs_diff"].append(float((labels.probs[:, 1 + k:] - r_p[:, :n]).abs().max()))
        mine_m = labels.valid[0, 1 + k:]
        ref_m = r_m[0, :n, 0].bool()
        out["mask_differs_at"].append([int(t) for t in torch.nonzero(mine_m != ref_m).flatten()])
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "agree":
        ap = argparse.ArgumentParser(prog="reference_step.py agree", description=agree.__doc__.split("\n")[0])
        ap.add_argument("--specforge", type=Path, default=BENCH.parent / ".ref" / "SpecForge")
        ap.add_argument("--seq", type=int, default=48)
        ap.add_argument("--attention", default="flex_attention", choices=["flex_attention", "sdpa"],
                        help="the reference's attention backend (forward only here, so flex runs on a CPU)")
        args = ap.parse_args(sys.argv[2:])
        sys.path.insert(0, str(BENCH.parent / "src"))
        print(json.dumps(agree(args.specforge, args.seq, attention=args.attention)))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "report":
        ap = argparse.ArgumentParser(prog="reference_step.py report", description=report.__doc__.split("\n")[0])
        ap.add_argument("--eyas", type=Path, required=True, help="bench/train_step.py --out JSON")
        ap.add_argument("--ref", type=Path, required=True, help="this script's --out JSON")
        args = ap.parse_args(sys.argv[2:])
        print("\n".join(report(args.eyas, args.ref)))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--specforge", type=Path, default=BENCH.parent / ".ref" / "SpecForge",
                    help="the fetched copy (holds specforge/); default .ref/SpecForge")
    ap.add_argument("--shape", nargs="+", default=["llama31-8b"], choices=sorted(SHAPES))
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape (checks the harness, not the speed)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip configurations once this much time passed")
    ap.add_argument("--batch", type=int, nargs="+", default=[1],
                    help="sequences a step (the reference's --batch-size; the equal-memory table raises it)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    device = torch.device(args.device)
    sys.path.insert(0, str(BENCH.parent / "src"))
    _init_single_rank(device)
    mods = import_reference(args.specforge, cpu_loss=device.type != "cuda")
    shapes = ["tiny"] if args.tiny else args.shape
    rows, t0 = [], time.time()
    for shape, T, bsz in [(s, t, b) for s in shapes for t in args.seq for b in args.batch]:
        if time.time() - t0 > args.budget_s:
            print(f"skip {shape} T={T} batch {bsz}: time budget spent", flush=True)
            continue
        try:
            r = measure(mods, shape, T, args.ttt, device, args.warmup, args.iters, bsz)
        except Exception as e:  # an OOM or a compile failure is a result too
            r = {"shape": shape, "seq": T, "batch": bsz,
                 "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(r)
        print(json.dumps(r), flush=True)
        if args.out:
            args.out.write_text(json.dumps({"rows": rows, "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
