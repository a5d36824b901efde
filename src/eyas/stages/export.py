"""export: write the trained draft as folders engines load as they are (``export/sglang``, ``export/vllm``).

Each folder gets ``eyas_export.json`` (the aux layers the drafter was trained on, the target, the convention), and is
then re-read by :func:`eyas.export.check.check_folder` with the target's config: an export that an engine would
skip, misread or refuse fails the stage instead of failing silently in production.
"""

from __future__ import annotations

import torch

from ..errors import EyasError
from ..export.check import MANIFEST, check_folder
from ..export.sglang import write_sglang
from ..export.vllm import write_vllm
from ..io import write_json_atomic
from ..summaries import ExportSummary
from ..targets.load import materialize_target, read_target_config
from . import RunContext
from .train import load_trained_draft

READS = ("export", "target")
INPUTS = ("train",)


def run(ctx: RunContext) -> ExportSummary:
    cfg = ctx.cfg.export
    model, meta = load_trained_draft(ctx, torch.device("cpu"))
    target_cfg = read_target_config(ctx.cfg.target)
    ids, conv = meta["aux_layer_ids"], meta["layer_convention"]
    out, checks = {}, {}
    for fmt in cfg.formats:
        d = ctx.run.export(fmt)
        if fmt == "sglang":
            write_sglang(d, model, ids, conv, target_cfg)
        else:
            verifier = cfg.verifier or str(materialize_target(ctx.cfg.target).resolve())
            write_vllm(d, model, ids, conv, target_cfg, verifier=verifier,
                       num_speculative_tokens=cfg.num_speculative_tokens)
        write_json_atomic(d / MANIFEST, {"aux_layer_ids": ids, "layer_convention": conv, "target": meta["target"],
                                         "format": fmt})
        rep = check_folder(d, target_cfg)
        engines = ("sglang", "vllm") if fmt == "sglang" else ("vllm",)
        errors = [f for e in engines for f in rep.errors(e)]
        if errors:
            raise EyasError(f"export check failed for {d}:\n" + "\n".join(f"  {f}" for f in errors))
        out[fmt] = str(d)
        checks[fmt] = {"captured_hf_index": rep.captured, "warnings": [str(f) for f in rep.findings
                                                                       if f.level == "warning"]}
        ctx.log(f"[eyas] export: {fmt} folder {d} (checked: {', '.join(engines)})")
    return ExportSummary(folders=out, checks=checks)
