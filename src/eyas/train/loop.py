"""The training loop, top to bottom: batch, target states, labels, forward (TTT), loss, backward, step, log,
evaluate, checkpoint.

Exact resume: the batches are a function of (seed, epoch) only (:func:`eyas.train.data.epoch_plan`), and a
checkpoint holds the model, optimizer, step and data position, so a resumed run continues with the same batches
and, on CPU, the same loss trajectory step for step. Distribution is the :class:`~eyas.distributed.Dist`
context applied once; see that module for why N processes equal one process with an N times larger batch.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from tqdm import tqdm

from ..config import TrainConfig
from ..data.vocab import draft_to_target_ids
from ..distributed import Dist
from ..errors import EyasError
from ..io import JsonlAppender
from ..model.eagle3 import Eagle3DraftModel
from .checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from .data import STATE_KEYS, collate, epoch_plan, micro_batch_loader
from .fp8 import Fp8Conversion, apply_fp8_training, fp8_lm_head_unavailable
from .loss import TargetLabels, batch_labels, step_counts, ttt_loss_fused
from .metrics import StepMetrics

# batch dict (from collate, on the device) -> the same dict with ``aux`` [B, T, L*Ht] and ``last`` [B, T, Ht] filled
# (offline: already there; online: the target run on the batch)
StateSource = Callable[[dict, torch.device], dict]


def stored_states(batch: dict, device: torch.device) -> dict:
    """Offline: the states (``aux`` and ``last``, or a top-k store's ``label_*``) came from the store with the
    batch; make sure they are on the device."""
    return {**batch, **{k: batch[k].to(device) for k in STATE_KEYS if k in batch}}


@dataclass
class TrainResult:
    """``final_state``: the draft's trainable tensors (full, CPU; gathered under FSDP), on process 0 only.
    ``fp8``: what ``train.fp8`` did (the recipe used, or the reason it fell back); ``fp8_lm_head``: whether the
    lm_head's products ran in fp8 (``train.fp8_lm_head``, False on a fallback)."""

    steps: int
    tokens: int
    final_metrics: dict
    seconds: float
    final_state: dict
    stopped_early: bool = False
    fp8: Fp8Conversion = Fp8Conversion("off")
    fp8_lm_head: bool = False


@dataclass
class Speed:
    """How the loop runs on this device (``train.compile``/``autocast``/``loader_workers`` resolved): compile the
    layer parts and loss chunks, bf16 autocast, DataLoader workers, and the padded-length multiple."""

    compile: bool
    autocast: bool
    workers: int
    pad_to: int

    @classmethod
    def resolve(cls, cfg: TrainConfig, device: torch.device, offline: bool) -> "Speed":
        cuda = device.type == "cuda"
        workers = cfg.loader_workers if cfg.loader_workers is not None else (
            min(8, max(1, (os.cpu_count() or 2) // 2)) if cuda and offline else 0)
        return cls(compile=cfg.compile if cfg.compile is not None else cuda,
                   autocast=cfg.autocast == "bfloat16" or (cfg.autocast == "auto" and cuda),
                   workers=workers, pad_to=64 if cuda else 1)


class StepSums:
    """One optimizer step's sums, kept on the device (no host sync while the micro-batches run): loss, micro-batch
    count, real tokens, then per TTT step the loss, the argmax hits and the counted positions, then the gradient
    norm. :meth:`to_host` is the step's one device-to-host transfer."""

    def __init__(self, K: int, device: torch.device):
        self.K = K
        self.t = torch.zeros(3 + 3 * K + 1, dtype=torch.float64, device=device)

    def add(self, loss: torch.Tensor, tokens: torch.Tensor, m: dict, counts: torch.Tensor) -> None:
        K = self.K
        one = torch.ones((), dtype=torch.float64, device=self.t.device)
        self.t[:-1] += torch.stack([loss.detach().double(), one, tokens.double()]
                                   + [m[f"loss_{k}"].double() for k in range(K)]
                                   + [m[f"hits_{k}"].double() for k in range(K)] + list(counts.double()))

    def to_host(self, dist: Dist, grad_norm: torch.Tensor, stop_asked: bool = False) -> dict:
        """Sum the loss terms over processes (counts are global already) and whether any process was asked to stop,
        then one transfer. Returns ``{loss, micro, tokens, loss_k, hits_k, count_k, grad_norm, stop}`` (per-process
        means where it applies; ``stop`` the same on every process, so that all of them stop after the same step
        even when a STOP file appears between their checks)."""
        K = self.K
        self.t[-1] = grad_norm.double()
        summed = dist.all_reduce(torch.cat([self.t[:3 + 2 * K], self.t.new_tensor([float(stop_asked)])]))
        self.t[:3 + 2 * K] = summed[:-1]
        v = torch.cat([self.t, summed[-1:]]).tolist()
        n_micro = max(v[1] / dist.world, 1)
        return {"loss": v[0] / n_micro, "tokens": int(v[2]),
                "loss_k": [x / n_micro for x in v[3: 3 + K]], "hits_k": v[3 + K: 3 + 2 * K],
                "count_k": [int(x) for x in v[3 + 2 * K: 3 + 3 * K]], "grad_norm": v[-2], "stop": v[-1] > 0}


class DeviceBatches:
    """The loop's batches, on the device and one ahead: the next CPU batch (pinned by the DataLoader) is copied on
    a side stream while the current step computes; then ``states`` fills its hidden states (offline: they came
    with it; online: the target runs on it) and they are cast to the training dtype."""

    def __init__(self, cpu_batches, states: StateSource, device: torch.device, dtype: torch.dtype):
        self.it, self.states, self.device, self.dtype = iter(cpu_batches), states, device, dtype
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ahead = self._copy()

    def _copy(self):
        cpu = next(self.it, None)
        if cpu is None:
            return None
        if self.stream is None:
            return cpu, None
        with torch.cuda.stream(self.stream):
            dev = {k: (v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in cpu.items()}
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return dev, ev

    def __next__(self) -> dict:
        if self.ahead is None:
            raise StopIteration
        batch, ev = self.ahead
        if ev is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(ev)
            for v in batch.values():
                if torch.is_tensor(v):
                    v.record_stream(cur)
        self.ahead = self._copy()
        b = self.states(batch, self.device)
        b = {**b, **{k: b[k].to(self.dtype) for k in ("aux", "last") if k in b}}
        if b.get("weightless"):  # no sample for this process in the epoch's last global micro-batch
            b.update(loss_mask=torch.zeros_like(b["loss_mask"]), ids=[],
                     attention_mask=torch.zeros_like(b["attention_mask"]))
        return b


class DraftWithLoss(nn.Module):
    """The unit the distribution wrapper wraps: the draft's TTT forward and the fused loss in one ``forward``, so
    DDP's and FSDP2's hooks see every parameter the loss uses (``norm``, ``lm_head``) inside one call. The loss
    itself lives in :mod:`eyas.train.loss`; the draft keeps the served checkpoint's attribute names."""

    def __init__(self, draft: Eagle3DraftModel, cfg: TrainConfig, compiled: bool, fp8_lm_head: bool = False):
        super().__init__()
        self.draft = draft
        self.ttt_steps, self.decay, self.compiled = cfg.ttt_steps, cfg.ttt_decay, compiled
        self.fp8_lm_head = fp8_lm_head      # train.fp8_lm_head, where the device can (train() decides)

    def forward(self, input_ids: torch.Tensor, aux: torch.Tensor, labels: TargetLabels,
                denominators: torch.Tensor) -> tuple[torch.Tensor, dict]:
        hiddens = self.draft(input_ids, aux, self.ttt_steps)
        return ttt_loss_fused(hiddens, self.draft.norm, self.draft.lm_head.weight, labels, self.decay,
                              compiled=self.compiled, denominators=denominators, fp8=self.fp8_lm_head)


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``warmup_ratio * total`` steps, then cosine decay to ``lr * min_lr_ratio``."""
    warm = max(1, int(round(cfg.warmup_ratio * total)))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


class Plan:
    """The global micro-batches of every epoch and the run's length in micro-batches. Epochs may hold different
    numbers of micro-batches (token-budget buckets depend on the epoch's order): micro-batch m of the run is found
    by walking the epochs' own sizes; the run lasts ``ceil(epochs * size of epoch 0)`` micro-batches."""

    def __init__(self, dataset, cfg: TrainConfig, world: int):
        self.lengths = [dataset.num_tokens(i) for i in range(len(dataset))]
        self.cfg, self.world = cfg, world
        self._cache: dict[int, list] = {}
        self._sizes: dict[int, int] = {}
        self.per_epoch = self.size(0)
        self.total_micro = max(1, math.ceil(cfg.epochs * self.per_epoch))

    def epoch(self, e: int) -> list:
        if e not in self._cache:
            self._cache = {e: epoch_plan(self.lengths, self.cfg.batch_size, self.world, self.cfg.seed, e,
                                         self.cfg.batch_tokens)}
        return self._cache[e]

    def size(self, e: int) -> int:
        if e not in self._sizes:
            self._sizes[e] = len(self.epoch(e))
        return self._sizes[e]

    def micro(self, micro: int, rank: int) -> list[int]:
        e = 0
        while micro >= self.size(e):
            micro -= self.size(e)
            e += 1
        return self.epoch(e)[micro][rank]


def train(model: Eagle3DraftModel, dataset, lm_head: torch.Tensor, cfg: TrainConfig, out_dir: Path,
          device: torch.device, fingerprint: dict, log=print, *, states: StateSource = stored_states,
          held_out=None, should_stop: Callable[[int], bool] | None = None) -> TrainResult:
    """Train ``model`` on ``dataset``; checkpoints and metrics go to ``out_dir``. Resumes from the last checkpoint.

    Args:
        dataset: ``len``, ``num_tokens(i)`` and ``ds[i]`` -> dict (``input_ids``, ``loss_mask``, ``id`` and, offline,
            ``aux``/``last``): :class:`~eyas.train.data.SampleDataset`. Picklable when ``train.loader_workers`` > 0
            (the workers build batches from it).
        lm_head: [V, Ht] the target's lm_head weight (soft labels come from it and the post-norm last state).
        states: fills ``aux``/``last`` of a device batch: :func:`stored_states` (offline) or the target run on the
            batch (online, :class:`eyas.train.online.OnlineStates`).
        held_out: a dataset like ``dataset`` evaluated every ``cfg.eval_every`` steps (no gradient).
        should_stop: called once a step, with the number the step gets, before its update; True on any process
            checkpoints after that step and returns on every process (tests, schedulers that pre-empt, RUN/train/STOP).
    Raises:
        EyasError: when the loss or gradient norm is not finite (naming the step and sample ids), or when a
            checkpoint in ``out_dir`` was made with another configuration.
    """
    dist = Dist.from_env(device, cfg.distributed)
    device = dist.device
    speed = Speed.resolve(cfg, device, offline=states is stored_states)
    model.to(device)
    float_dtype = torch.bfloat16 if speed.autocast else torch.float32
    # before compile and the DDP/FSDP2 wrapper, which must see the converted modules; state_dict keys unchanged
    fp8 = apply_fp8_training(model, cfg.fp8, device, log, matmul_dtype=float_dtype)
    head_fp8 = False
    if cfg.fp8_lm_head:
        why = fp8_lm_head_unavailable(device, tuple(model.lm_head.weight.shape))
        head_fp8 = why is None
        log("[eyas] train: train.fp8_lm_head: the draft lm_head's products in fp8 (tensorwise scaling) inside the "
            "fused loss" if head_fp8 else f"[eyas] train: train.fp8_lm_head is not used: {why}: the lm_head's "
            f"products stay in {str(float_dtype).removeprefix('torch.')}")
    attention = cfg.attention
    if attention == "flex" and device.type == "cpu":   # flex_attention has no CPU backward (torch 2.11-2.13)
        warnings.warn("train.attention=flex has no backward on the CPU: training with 'sdpa' (the same function)",
                      stacklevel=2)
        attention = "sdpa"
    model.set_attention(attention)
    model.gradient_checkpointing = cfg.gradient_checkpointing
    if speed.compile:
        model.compile_ttt()
    lm_head = lm_head.to(device, float_dtype if speed.autocast else lm_head.dtype)
    trainable_keys = set(model.trainable_state_dict())
    step_module = dist.wrap(DraftWithLoss(model, cfg, speed.compile, fp8_lm_head=head_fp8))
    params = [p for p in step_module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                            fused=device.type == "cuda" and not (dist.world > 1 and cfg.distributed == "fsdp"))
    plan = Plan(dataset, cfg, dist.world)
    total_steps = math.ceil(plan.total_micro / cfg.grad_accum)
    ckpt_dir = out_dir / "checkpoints"

    step, micro = _resume(ckpt_dir, step_module, opt, dist, fingerprint, out_dir, log, total_steps)
    draft_ids = draft_to_target_ids(model.d2t.to(device))   # after resume: the run's
    t2d = model.t2d
    batches = DeviceBatches(micro_batch_loader(dataset, plan, dist.rank, micro, speed.workers,
                                               device.type == "cuda", speed.pad_to), states, device, float_dtype)
    writers = _Writers(out_dir, cfg, dist) if dist.is_main else None
    bar = tqdm(total=total_steps, initial=step, desc="train", unit="step", dynamic_ncols=True,
               disable=not dist.is_main)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=speed.autocast)
    K = cfg.ttt_steps
    t0, t_prev, tokens_seen, metrics = time.time(), time.time(), 0, None
    best_acc, evals_without_gain, stopped_early = -1.0, 0, False
    step_module.train()
    while step < total_steps:
        # ---- one optimizer step: grad_accum micro-batches, sums kept on the device
        lr = lr_at(step, total_steps, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        sums = StepSums(K, device)
        batch_ids: list[str] = []
        for _ in range(cfg.grad_accum):
            if micro >= plan.total_micro:
                break
            batch = next(batches)
            batch_ids += batch["ids"]
            labels = batch_labels(batch, lm_head, draft_ids, t2d)
            counts = dist.all_reduce(step_counts(labels, K))                       # [K], global batch
            with autocast:
                loss, m = step_module(batch["input_ids"], batch["aux"], labels, counts)
            (loss * dist.world / cfg.grad_accum).backward()  # DDP/FSDP average; the global loss is the sum
            sums.add(loss, batch["attention_mask"].sum(), m, counts)
            micro += 1
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        asked = should_stop is not None and should_stop(step + 1)                  # asked after this step
        v = sums.to_host(dist, grad_norm, asked)                                    # the step's one host sync
        if not (math.isfinite(v["loss"]) and math.isfinite(v["grad_norm"])):
            raise EyasError(f"train: non-finite loss ({v['loss']}) or gradient norm ({v['grad_norm']}) at step "
                            f"{step + 1}; samples in this step: {', '.join(batch_ids)}")
        opt.step()
        step += 1
        now = time.time()
        tokens_seen += v["tokens"]
        metrics = StepMetrics(
            step=step, loss=v["loss"], loss_k=v["loss_k"],
            acc_k=[h / max(c, 1) for h, c in zip(v["hits_k"], v["count_k"])], count_k=v["count_k"], lr=lr,
            grad_norm=v["grad_norm"], tokens=tokens_seen, tokens_per_s=tokens_seen / max(now - t0, 1e-9),
            recent_tokens_per_s=v["tokens"] / max(now - t_prev, 1e-9),
            gpu_max_memory_gb=torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None)
        t_prev = now
        if held_out is not None and len(held_out) and (step % cfg.eval_every == 0 or step == total_steps):
            ev = evaluate_held_out(step_module, held_out, states, lm_head, draft_ids, t2d, cfg, dist, autocast,
                                   float_dtype, speed.pad_to)
            metrics.eval_loss, metrics.eval_acc_k = ev["eval_loss"], [ev[f"eval_acc_{k}"] for k in range(K)]
            gain = metrics.eval_acc_k[0] - best_acc
            best_acc, evals_without_gain = max(best_acc, metrics.eval_acc_k[0]), (
                0 if gain > cfg.stop_min_gain else evals_without_gain + 1)
            stopped_early = bool(cfg.stop_after_no_gain) and evals_without_gain >= cfg.stop_after_no_gain
        if writers:
            writers.log(metrics.to_json())
        bar.update(1)
        if step % cfg.log_every == 0 or step == total_steps:
            accs = " ".join(f"{a:.2f}" for a in metrics.acc_k)
            bar.set_postfix_str(f"loss {metrics.loss:.3f} acc {accs} {metrics.recent_tokens_per_s:.0f} tok/s")
        stop = stopped_early or v["stop"]
        if step % cfg.checkpoint_every == 0 or step == total_steps or stop:
            _checkpoint(ckpt_dir, step, micro, total_steps, fingerprint, metrics.to_json(), step_module, opt, dist,
                        trainable_keys, cfg.keep_last, writers)
        if stopped_early:
            log(f"[eyas] train: held-out step-0 accuracy has not risen by more than {cfg.stop_min_gain} in "
                f"{evals_without_gain} evaluations (best {best_acc:.4f}): stopping at step {step} of {total_steps}")
        if stop:
            break
    bar.close()
    if writers:
        writers.close()
    full = dist.model_state(step_module)
    final_state = {k[len("draft."):]: v for k, v in full.items() if k[len("draft."):] in trainable_keys}
    return TrainResult(steps=step, tokens=tokens_seen, final_metrics=metrics.to_json() if metrics else {},
                       seconds=time.time() - t0, final_state=final_state if dist.is_main else {},
                       stopped_early=stopped_early, fp8=fp8, fp8_lm_head=head_fp8)


@torch.no_grad()
def evaluate_held_out(step_module, held_out, states: StateSource, lm_head, draft_ids, t2d, cfg: TrainConfig,
                      dist: Dist, autocast, float_dtype: torch.dtype = torch.float32, pad_to: int = 1) -> dict:
    """Loss and per-step accuracy on the held-out samples (each process takes every world-th batch):
    ``eval_loss`` = sum_k decay^k (held-out CE of step k averaged over its counted positions), ``eval_acc_k``.
    Every process runs the same number of forward passes (DDP/FSDP collectives); a process with no batch left in
    a round repeats the first batch with weight 0."""
    K = cfg.ttt_steps
    sums = torch.zeros(3 * K, dtype=torch.float64, device=dist.device)     # ce_k sums, hits_k, counts_k
    step_module.eval()
    starts = list(range(0, len(held_out), cfg.batch_size))
    for r in range(0, len(starts), dist.world):
        mine = r + dist.rank < len(starts)
        b = starts[r + dist.rank] if mine else 0
        cpu = collate([held_out[i] for i in range(b, min(b + cfg.batch_size, len(held_out)))], pad_to)
        batch = states({k: (v.to(dist.device) if torch.is_tensor(v) else v) for k, v in cpu.items()}, dist.device)
        labels = batch_labels(batch, lm_head, draft_ids, t2d, float_dtype)
        ones = torch.ones(K, device=dist.device)        # denominators 1: the loss terms are CE sums
        with autocast:
            _, m = step_module(batch["input_ids"], batch["aux"].to(float_dtype), labels, ones)
        if mine:
            sums += torch.stack([m[f"loss_{k}"] for k in range(K)] + [m[f"hits_{k}"] for k in range(K)]
                                + [m[f"count_{k}"] for k in range(K)]).double()
    step_module.train()
    vals = dist.all_reduce(sums).tolist()
    out = {"eval_loss": sum(cfg.ttt_decay ** k * vals[k] / max(vals[2 * K + k], 1) for k in range(K))}
    for k in range(K):
        out[f"eval_acc_{k}"] = vals[K + k] / max(vals[2 * K + k], 1)
    return out


def _resume(ckpt_dir: Path, step_module, opt, dist: Dist, fingerprint: dict, out_dir: Path, log,
            total_steps: int) -> tuple[int, int]:
    ckpts = list_checkpoints(ckpt_dir)
    if not ckpts:
        return 0, 0
    model_state, opt_state, state = load_checkpoint(ckpts[-1], torch.device("cpu"))
    if state.get("fingerprint") != fingerprint:
        raise EyasError(f"{ckpts[-1]} was written with another configuration; use --force to restart training")
    dist.load_states(step_module, opt, {f"draft.{k}": v for k, v in model_state.items()}, opt_state)
    step, micro = state["step"], state["micro"]
    if dist.is_main:  # metrics logged after the checkpoint (a run killed between the two) are dropped
        _truncate_metrics(out_dir / "metrics.jsonl", step)
    dist.barrier()
    log(f"[eyas] train: resuming from {ckpts[-1].name} (step {step} of {total_steps})")
    return step, micro


def _truncate_metrics(path: Path, step: int) -> None:
    if not path.exists():
        return
    rows = [x for x in path.read_text().splitlines() if x.strip() and json.loads(x)["step"] <= step]
    path.write_text("".join(r + "\n" for r in rows))


def _checkpoint(ckpt_dir, step, micro, total_steps, fingerprint, metrics, step_module, opt, dist: Dist,
                trainable_keys: set, keep_last: int, writers) -> None:
    model_state = dist.model_state(step_module)        # every process takes part (FSDP gathers)
    opt_state = dist.optimizer_state(step_module, opt)
    if dist.is_main:
        if writers:
            writers.flush()
        draft_state = {k[len("draft."):]: v for k, v in model_state.items() if k[len("draft."):] in trainable_keys}
        save_checkpoint(ckpt_dir, step, draft_state, opt_state,
                        {"step": step, "micro": micro, "total_steps": total_steps, "fingerprint": fingerprint,
                         "metrics": metrics, "world": dist.world}, keep_last)
    dist.barrier()


class _Writers:
    """metrics.jsonl always; TensorBoard (``train.tensorboard``) and wandb (``train.wandb_project``) when asked."""

    def __init__(self, out_dir: Path, cfg: TrainConfig, dist: Dist):
        self.jsonl = JsonlAppender(out_dir / "metrics.jsonl", fsync_every=1 << 30)
        self.tb = self.wandb = None
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                warnings.warn("train.tensorboard is true but the tensorboard package is not installed "
                              "(pip install tensorboard); TensorBoard logging is off", stacklevel=2)
            else:
                self.tb = SummaryWriter(str(out_dir / "tensorboard"))
        if cfg.wandb_project:
            try:
                import wandb
            except ImportError:
                warnings.warn(f"train.wandb_project={cfg.wandb_project!r} is set but wandb is not installed "
                              f"(pip install wandb); wandb logging is off", stacklevel=2)
            else:
                self.wandb = wandb.init(project=cfg.wandb_project, dir=str(out_dir), config=cfg.model_dump(),
                                        resume="allow")

    def log(self, m: dict) -> None:
        self.jsonl.append(m)
        step = m["step"]
        if self.tb is not None:
            for k, v in m.items():
                if k == "step" or k.startswith("count_"):
                    continue
                group = ("eval" if k.startswith("eval_") else "ttt" if k[-1].isdigit() else "train")
                self.tb.add_scalar(f"{group}/{k}", v, step)
        if self.wandb is not None:
            self.wandb.log(m, step=step)

    def flush(self) -> None:
        self.jsonl.flush()
        if self.tb is not None:
            self.tb.flush()

    def close(self) -> None:
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()

