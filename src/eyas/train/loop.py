"""The training loop, top to bottom: data, forward (TTT), loss, backward, step, log, checkpoint.

Exact resume: the data order is a function of (seed, epoch) only, and a checkpoint holds the model, optimizer,
scheduler position and the data position, so a resumed run continues with the same batches and, on CPU, the same
loss trajectory step for step.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import TrainConfig
from ..errors import EyasError
from ..io import JsonlAppender
from ..model.eagle3 import Eagle3DraftModel
from .checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from .data import StoreDataset, collate, micro_batches
from .loss import target_labels, ttt_loss


@dataclass
class TrainResult:
    steps: int
    tokens: int
    final_metrics: dict
    seconds: float


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``warmup_ratio * total`` steps, then cosine decay to ``lr * min_lr_ratio``."""
    warm = max(1, int(round(cfg.warmup_ratio * total)))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def train(model: Eagle3DraftModel, dataset: StoreDataset, lm_head: torch.Tensor, cfg: TrainConfig,
          out_dir: Path, device: torch.device, fingerprint: dict, log=print) -> TrainResult:
    """Train ``model`` on ``dataset``; checkpoints and metrics go to ``out_dir``. Resumes from the last checkpoint.

    Raises :class:`EyasError` when the loss or gradient norm is not finite (naming the step and sample ids), or
    when a checkpoint in ``out_dir`` was made with another configuration.
    """
    model.to(device)
    lm_head = lm_head.to(device)
    draft_ids = (model.d2t + torch.arange(len(model.d2t), device=device)).long()
    t2d = model.t2d
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    per_epoch = math.ceil(len(dataset) / cfg.batch_size)
    total_micro = math.ceil(cfg.epochs * per_epoch)
    total_steps = math.ceil(total_micro / cfg.grad_accum)
    ckpt_dir = out_dir / "checkpoints"

    step, micro = 0, 0
    ckpts = list_checkpoints(ckpt_dir)
    if ckpts:
        model_state, opt_state, state = load_checkpoint(ckpts[-1], device)
        if state.get("fingerprint") != fingerprint:
            raise EyasError(f"{ckpts[-1]} was written with another configuration; use --force to restart training")
        model.load_state_dict(model_state, strict=False)
        opt.load_state_dict(opt_state)
        step, micro = state["step"], state["micro"]
        log(f"[eyas] train: resuming from {ckpts[-1].name} (step {step} of {total_steps})")

    metrics_log = JsonlAppender(out_dir / "metrics.jsonl", fsync_every=1 << 30)
    bar = tqdm(total=total_steps, initial=step, desc="train", unit="step", dynamic_ncols=True)
    t0, tokens_seen, last_metrics = time.time(), 0, {}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.autocast == "bfloat16")
    model.train()
    while step < total_steps:
        # ---- one optimizer step: grad_accum micro-batches
        lr = lr_at(step, total_steps, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        agg: dict = {}
        batch_ids: list[str] = []
        for _ in range(cfg.grad_accum):
            if micro >= total_micro:
                break
            epoch, within = divmod(micro, per_epoch)
            idx = micro_batches(len(dataset), cfg.batch_size, cfg.seed, epoch)[within]
            batch = collate([dataset[i] for i in idx])
            batch_ids += batch["ids"]
            ids = batch["input_ids"].to(device)
            mask = batch["loss_mask"].to(device)
            aux = batch["aux"].to(device).float()
            last = batch["last"].to(device).float()
            labels = target_labels(last, lm_head, draft_ids, t2d, mask)
            with autocast:
                hiddens = model(ids, aux, cfg.ttt_steps)
                logits = [model.logits(h) for h in hiddens]
            loss, m = ttt_loss(logits, labels, cfg.ttt_decay)
            (loss / cfg.grad_accum).backward()
            micro += 1
            tokens_seen += int(mask.numel())
            for k, v in m.items():
                agg[k] = agg.get(k, 0) + v
            agg["loss"] = agg.get("loss", 0) + loss.item()
            agg["n"] = agg.get("n", 0) + 1
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        if not (math.isfinite(agg["loss"]) and torch.isfinite(grad_norm)):
            raise EyasError(f"train: non-finite loss ({agg['loss']}) or gradient norm ({float(grad_norm)}) at step "
                            f"{step}; samples in this step: {', '.join(batch_ids)}")
        opt.step()
        step += 1
        n = agg.pop("n")
        last_metrics = {k: (v / n if not k.startswith("count_") else v) for k, v in agg.items()}
        last_metrics.update(step=step, lr=lr, grad_norm=float(grad_norm),
                            tokens_per_s=tokens_seen / max(time.time() - t0, 1e-9))
        metrics_log.append(last_metrics)
        bar.update(1)
        if step % cfg.log_every == 0 or step == total_steps:
            accs = " ".join(f"{last_metrics.get(f'acc_{k}', 0):.2f}" for k in range(cfg.ttt_steps))
            bar.set_postfix_str(f"loss {last_metrics['loss']:.3f} acc {accs}")
        if step % cfg.checkpoint_every == 0 or step == total_steps:
            metrics_log.flush()
            save_checkpoint(ckpt_dir, step, model.trainable_state_dict(), opt,
                            {"step": step, "micro": micro, "total_steps": total_steps, "fingerprint": fingerprint,
                             "metrics": last_metrics}, cfg.keep_last)
    bar.close()
    metrics_log.close()
    return TrainResult(steps=step, tokens=tokens_seen, final_metrics=last_metrics, seconds=time.time() - t0)


def summarise_metrics(path: Path, ttt_steps: int, last_fraction: float = 0.1) -> dict:
    """Mean loss and per-step accuracy over the last ``last_fraction`` of logged steps (a stable end-of-run view)."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    if not rows:
        return {}
    tail = rows[-max(1, int(len(rows) * last_fraction)):]
    out = {"loss": sum(r["loss"] for r in tail) / len(tail),
           "first_loss": rows[0]["loss"], "steps": rows[-1]["step"]}
    for k in range(ttt_steps):
        out[f"acc_{k}"] = sum(r.get(f"acc_{k}", 0.0) for r in tail) / len(tail)
    return out
