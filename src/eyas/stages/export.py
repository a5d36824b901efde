"""export: write the trained draft as folders engines load as they are (``export/sglang``)."""

from __future__ import annotations

import torch

from ..export.sglang import write_sglang
from ..targets.load import read_target_config
from . import RunContext
from .train import load_trained_draft


def run(ctx: RunContext) -> dict:
    model, meta = load_trained_draft(ctx, torch.device("cpu"))
    target_cfg = read_target_config(ctx.cfg.target)
    out = {}
    for fmt in ctx.cfg.export.formats:
        if fmt == "sglang":
            d = write_sglang(ctx.stage_dir("export") / "sglang", model, meta["aux_layer_ids"],
                             meta["layer_convention"], target_cfg)
            out["sglang"] = str(d)
            ctx.log(f"[eyas] export: SGLang folder {d}")
    return {"folders": out}
