"""train: the EAGLE-3 draft with training-time test, offline from the store.

The draft vocabulary and layer ids are read from the run (vocab stage, store header), never recomputed.
Writes ``train/checkpoints/step-*/``, ``train/metrics.jsonl`` and ``train/final/`` (``draft.safetensors`` +
``draft_config.json``), from which export builds the engine folders.
"""

from __future__ import annotations

import json

import torch

from ..io import read_json, write_json_atomic
from ..store import HiddenStateStore
from ..targets.load import load_target_head, read_target_config, resolve_device
from ..train.build import build_draft, draft_config_for
from ..train.checkpoint import save_checkpoint  # noqa: F401  (re-exported for tools)
from ..train.data import StoreDataset
from ..train.loop import summarise_metrics, train
from . import RunContext, stage_fingerprint
from .extract import store_path
from .tokenize import load_samples
from .vocab import load_vocab


def run(ctx: RunContext) -> dict:
    cfg = ctx.cfg.train
    out = ctx.stage_dir("train")
    d2t, t2d = load_vocab(ctx.stage_dir("vocab") / "vocab.safetensors")
    store = HiddenStateStore.open(store_path(ctx))
    target_cfg = read_target_config(ctx.cfg.target)
    dcfg = draft_config_for(target_cfg, cfg.draft, len(d2t), len(store.header.layer_ids))
    embed, lm_head = load_target_head(ctx.cfg.target)
    model = build_draft(dcfg, embed, d2t, t2d, cfg.seed)
    dataset = StoreDataset(load_samples(ctx), store, cfg.max_length)
    device = resolve_device(cfg.device)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ctx.log(f"[eyas] train: {len(dataset)} samples, draft {n_params / 1e6:.1f}M trainable parameters, "
            f"TTT {cfg.ttt_steps} steps, device {device}")
    result = train(model, dataset, lm_head, cfg, out, device, stage_fingerprint(ctx.cfg, "train"), log=ctx.log)
    final = out / "final"
    final.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in model.trainable_state_dict().items()},
              str(final / "draft.safetensors"))
    write_json_atomic(final / "draft_config.json", {
        "draft": dcfg.to_dict(), "aux_layer_ids": store.header.layer_ids,
        "layer_convention": store.header.layer_convention, "target": store.header.target,
        "ttt_steps": cfg.ttt_steps,
    })
    summary = summarise_metrics(out / "metrics.jsonl", cfg.ttt_steps)
    summary.update(trainable_parameters=n_params, steps=result.steps)
    return summary


def load_trained_draft(ctx: RunContext, device: torch.device):
    """The trained draft of this run (from ``train/final``), with the target's embedding table, in eval mode."""
    from safetensors.torch import load_file

    from ..model.eagle3 import Eagle3Config, Eagle3DraftModel

    final = ctx.stage_dir("train") / "final"
    meta = read_json(final / "draft_config.json")
    model = Eagle3DraftModel(Eagle3Config(**meta["draft"]))
    embed, _ = load_target_head(ctx.cfg.target)
    state = load_file(str(final / "draft.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    bad = [k for k in missing if not k.startswith(("embed_tokens.", "rotary."))]
    if bad or unexpected:
        raise RuntimeError(f"draft weights do not match the model: missing {bad}, unexpected {unexpected}")
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
    return model.to(device).eval(), meta


__all__ = ["run", "load_trained_draft", "json"]
